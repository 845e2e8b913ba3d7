"""Multi-turn rollouts: trajectories of model turns and environment observations, token in, token out.

A trajectory is the prompt ids, then for every turn the ids the engine generated, exactly as generated,
then the observation rendered in the chat template's tool-response format and tokenized. Nothing is ever
re-tokenized from text, so the trainer scores the very tokens that were sampled; the loss mask is 1 on
generated tokens only and the rollout logprobs are 0 on observation tokens.

Scheduling: each round, every active trajectory's context goes to the engine as one batch; then the
environment steps of all trajectories whose turn ended run concurrently on a thread pool. A step that
runs past its limit, min(env.tool_timeout_s, what is left of env.max_tool_time_s), ends its trajectory
with "tool_time" while the others go on (the thread is left to finish on its own: Python cannot stop
it; the built-in tools bound themselves, the python tool by the sandbox's wall-clock kill). A finished
trajectory leaves the batch. Finish reasons:

    stop        the environment said done (the turn was the final answer)
    length      a turn reached rollout.max_new_tokens without the stop token
    max_turns   env.max_turns turns, the last of them still calling a tool
    max_tokens  the response (generated and observation tokens) reached env.max_tokens
    tool_time   an environment step ran past its limit
    env_error   an environment step raised env.retries + 1 times (logged; the trajectory keeps what it has)

A step that raises is tried again on a fresh environment, reset with the trajectory's row and given the
trajectory's earlier turns again (each must answer as the first environment did; one that answers otherwise
cannot go on in its place), up to env.retries times per trajectory; `Trajectory.env_retries` counts them.
The replay runs within the step's time limit.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial

from torch import Tensor

from megarl.config import EnvConfig
from megarl.envs.environment import Environment, Step
from megarl.envs.tool_format import ObservationFormat
from megarl.rollout.engine import EngineError, Generation

log = logging.getLogger(__name__)

LIMITS = ("length", "max_turns", "max_tokens", "tool_time")  # finish reasons of a limit, not of the model
FINISH_REASONS = ("stop", *LIMITS, "env_error")
_POLL_S = 0.05  # how often the scheduler looks at steps still waiting for a pool thread


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # generated and observation ids, in order
    generated_mask: list[int] = field(default_factory=list)  # 1 on generated ids, 0 on observation ids
    logprobs: list[float] = field(default_factory=list)  # the engine's logprob of each generated id, else 0
    last_turn: list[int] = field(default_factory=list)  # the ids of the model's last turn
    finish_reason: str = ""  # one of FINISH_REASONS once finished
    turns: int = 0
    tool_calls: int = 0
    tool_time_s: float = 0.0
    env_reward: float = 0.0  # sum of the environment's step rewards; 0 once one failed
    # why the environment's reward failed (a step reward that is not a finite number), naming env.name; the
    # sample then fails as a reward term's failure fails it (megarl.rewards.scorer)
    env_reward_failure: str | None = None
    last_turn_text: str | None = None  # the last turn decoded for the rewards, once it is final
    # MoE: the engine's routes of the last call's prompt and response (megarl.rollout.engine.Generation), which
    # hold every earlier turn too; they may run past a turn cut to its token budget
    routes: Tensor | None = None
    # the weight version that sampled each response id (0 on observation ids, and where the engine records none)
    versions: list[int] = field(default_factory=list)
    # what each environment step was given and returned, in order: a fresh environment replays them
    stepped: list[tuple[str, Step]] = field(default_factory=list)
    env_retries: int = 0  # environment steps tried again on a fresh environment

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Append generated ids (with their logprobs) or, with logprobs None, observation ids."""
        self.response_ids += ids
        self.generated_mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else logprobs
        self.versions += [0] * len(ids)

    def mark(self) -> tuple:
        """What an engine call may change, to `undo` it when the call fails."""
        return len(self.response_ids), self.turns, self.finish_reason, self.last_turn, self.last_turn_text

    def undo(self, mark: tuple) -> None:
        """Back to `mark`: the ids, logprobs and turn of a failed engine call are dropped."""
        n, self.turns, self.finish_reason, self.last_turn, self.last_turn_text = mark
        for ids in (self.response_ids, self.generated_mask, self.logprobs, self.versions):
            del ids[n:]


class EnvWorkers:
    """The threads that run environment steps, kept from one `run_trajectories` call to the next: starting
    a pool's threads costs milliseconds, as much as a small model's whole decode. A step left running past
    its limit keeps its thread busy, so a call in which one did retires the pool (its threads finish on
    their own) and the next call starts a fresh one."""

    def __init__(self, size: int):
        self.size = size
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="megarl-env")
        return self._pool

    def retire(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def run_trajectories(engine, prompts: Sequence[list[int]], envs: Sequence[Environment],
                     rows: Sequence[tuple[str, dict]], *, tokenizer, observations: ObservationFormat | None,
                     limits: EnvConfig, temperature: float, top_p: float, max_new_tokens: int,
                     on_last_turn: Callable[[int, Trajectory], None] | None = None,
                     workers: EnvWorkers | None = None) -> list[Trajectory]:
    """One trajectory per prompt, each with its own environment: `TrajectoryRun(...).run(engine, workers)` (no
    environment made anew: a step that raises ends its trajectory)."""
    return TrajectoryRun(prompts, envs, rows, tokenizer=tokenizer, observations=observations, limits=limits,
                         temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                         on_last_turn=on_last_turn).run(engine, workers)


class TrajectoryRun:
    """The trajectories of a set of prompts, each with its own environment (reset with its row's (prompt
    text, metadata)), run to their end by `run`. `max_new_tokens` limits each turn; `limits` the turns,
    tokens and tool time of a trajectory. `observations` renders tool messages; it may be None only when no
    environment returns any.

    `on_last_turn(i, trajectory)` is called once per trajectory, as soon as its last turn is known, so
    its response can be scored while others are still generating: within the engine call, when the turn
    hit a token limit or was the last turn allowed; otherwise once its environment step ended it. Its
    response ids are final then; its finish reason and environment reward may not be yet.

    An engine call is all or nothing: when it fails (megarl.rollout.engine.EngineError; anything else the
    engine raises is turned into one), every response it gave is dropped, `on_retract(i)` withdraws each
    trajectory that `on_last_turn` had handed out during it, and `run` raises. The environments saw none of
    the call, so a later `run` on a new engine continues every trajectory from its last finished turn.

    `new_env` makes the fresh environments a step that raised is tried again on (env.retries); None: none.
    """

    def __init__(self, prompts: Sequence[list[int]], envs: Sequence[Environment], rows: Sequence[tuple[str, dict]],
                 *, tokenizer, observations: ObservationFormat | None, limits: EnvConfig, temperature: float,
                 top_p: float, max_new_tokens: int, on_last_turn: Callable[[int, Trajectory], None] | None = None,
                 on_retract: Callable[[int], None] | None = None, new_env: Callable[[], Environment] | None = None):
        self.rollout = _Rollout(list(envs), [Trajectory(list(p)) for p in prompts], tokenizer=tokenizer,
                                observations=observations, limits=limits, temperature=temperature, top_p=top_p,
                                max_new_tokens=max_new_tokens, on_last_turn=on_last_turn, on_retract=on_retract,
                                rows=list(rows), new_env=new_env)
        for env, (prompt, metadata) in zip(envs, rows):
            env.reset(prompt, metadata)
        self.active = list(range(len(prompts)))  # the trajectories that take another turn

    @property
    def trajectories(self) -> list[Trajectory]:
        return self.rollout.trajectories

    def run(self, engine, workers: EnvWorkers | None = None) -> list[Trajectory]:
        """Every trajectory to its end on `engine`; `workers` runs the environment steps (a pool of
        `env.tool_workers` threads for this call when None)."""
        rollout = self.rollout
        own_workers = workers is None
        workers = EnvWorkers(rollout.limits.tool_workers) if own_workers else workers
        left_running = False
        try:
            while self.active:
                stepping = rollout.generate_turns(engine, self.active)
                results = rollout.step_environments(stepping, workers)
                left_running |= results.timed_out
                self.active = rollout.answer_steps(stepping, results)
        except BaseException:
            left_running = True  # steps may still be queued or running
            raise
        finally:
            if own_workers or left_running:
                workers.retire()  # steps past their limit finish on their own
        return rollout.trajectories


@dataclass
class StepResults:
    """The environment steps of one round: the Step each returned, or why it returned none."""

    steps: dict[int, Step] = field(default_factory=dict)     # trajectory index -> the Step its environment returned
    failures: dict[int, str] = field(default_factory=dict)  # trajectory index -> "tool_time" or "env_error"

    def raised(self, i: int, error: Exception) -> None:
        """Trajectory `i`'s step raised `error`: logged, and its trajectory ends with "env_error"."""
        log.warning("environment step of trajectory %d raised %s: %s", i, type(error).__name__, error)
        self.failures[i] = "env_error"

    @property
    def timed_out(self) -> bool:
        """A step ran past its limit, so its thread may still be busy."""
        return "tool_time" in self.failures.values()


class _Rollout:
    """The trajectories of one `run_trajectories` call, and each round's three phases: the engine call that
    generates the active trajectories' turns, their environments' steps, and the observations appended."""

    def __init__(self, envs: list[Environment], trajectories: list[Trajectory], *, tokenizer,
                 observations: ObservationFormat | None, limits: EnvConfig, temperature: float, top_p: float,
                 max_new_tokens: int, on_last_turn: Callable[[int, Trajectory], None] | None,
                 on_retract: Callable[[int], None] | None, rows: list[tuple[str, dict]],
                 new_env: Callable[[], Environment] | None):
        self.envs, self.trajectories, self.rows, self.new_env = envs, trajectories, rows, new_env
        self.tokenizer, self.observations, self.limits = tokenizer, observations, limits
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.on_last_turn, self.on_retract = on_last_turn, on_retract
        self.handed_out: set[int] = set()  # the trajectories on_last_turn has been called for
        # single_turn's step always ends the episode, so its first turn is known to be the last one before the
        # step runs (the finish reason is still the step's "stop").
        self.max_turns = 1 if limits.kind == "single_turn" else limits.max_turns

    def last_turn_known(self, i: int) -> None:
        if self.on_last_turn is not None and i not in self.handed_out:
            self.handed_out.add(i)
            self.on_last_turn(i, self.trajectories[i])

    def finish(self, i: int, reason: str) -> None:
        self.trajectories[i].finish_reason = reason
        self.last_turn_known(i)

    def generate_turns(self, engine, active: list[int]) -> list[int]:
        """One engine call for every trajectory of `active` with tokens left; returns those whose turn
        ended in a step of their environment, in the trajectories' order (the others are finished). A failed
        call is undone (TrajectoryRun) and raised."""
        budget = {i: _tokens_left(self.trajectories[i], self.limits, self.max_new_tokens) for i in active}
        for i in [i for i in active if budget[i] <= 0]:
            self.finish(i, "max_tokens")
        active = [i for i in active if budget[i] > 0]
        if not active:
            return []
        # One engine call for every active trajectory; one whose token budget is below the turn limit
        # is cut to its budget afterwards (engines take one max_new_tokens per call).
        stepping: list[int] = []
        marks = {i: self.trajectories[i].mark() for i in active}
        handed_out = set(self.handed_out)
        try:
            generation = self.call_engine(engine, active, max_new_tokens=max(budget[i] for i in active),
                                          on_response=partial(self.end_turn, active, budget, stepping))
        except EngineError:
            for i in active:
                self.trajectories[i].undo(marks[i])
            for i in sorted(self.handed_out - handed_out):
                if self.on_retract is not None:
                    self.on_retract(i)
            self.handed_out = handed_out
            raise
        if generation.routes is not None:
            for i, routes in zip(active, generation.routes):
                self.trajectories[i].routes = routes
        if generation.versions is not None:  # this turn's kept ids end the response so far
            for i, versions in zip(active, generation.versions):
                kept = len(self.trajectories[i].last_turn)
                if kept:
                    self.trajectories[i].versions[-kept:] = versions[:kept]
        return sorted(stepping)  # responses end in any order; the next round's batch keeps the trajectories' order

    def call_engine(self, engine, active: list[int], *, max_new_tokens: int, on_response) -> Generation:
        """The engine's generate for the trajectories `active`. What the engine raises is an EngineError (its
        phase "generate"); what `on_response` raises is not the engine's and goes on unchanged."""
        ours: list[BaseException] = []
        answered: set[int] = set()
        start = time.monotonic()

        def respond(j: int, *response) -> None:
            if not 0 <= j < len(active) or j in answered:  # the engine's fault: the call is undone and retried
                raise EngineError(phase="generate", elapsed_s=time.monotonic() - start, cause=(
                    f"a response for prompt {j} of {len(active)}" + (" again" if j in answered else "")))
            answered.add(j)
            try:
                on_response(j, *response)
            except BaseException as e:
                ours.append(e)
                raise

        try:
            generation = engine.generate(
                [self.trajectories[i].prompt_ids + self.trajectories[i].response_ids for i in active],
                temperature=self.temperature, top_p=self.top_p, max_new_tokens=max_new_tokens,
                eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id, on_response=respond)
        except EngineError:
            raise
        except Exception as e:
            if ours:  # the callback's own error, perhaps wrapped by the engine
                raise ours[0]
            raise EngineError(phase="generate", cause=f"{type(e).__name__}: {e}",
                              elapsed_s=time.monotonic() - start) from e
        if len(answered) < len(active):  # lost prompts are generated again, never dropped from the step
            missing = sorted(set(range(len(active))) - answered)
            raise EngineError(phase="generate", elapsed_s=time.monotonic() - start, cause=(
                f"the engine returned {len(answered)} responses for {len(active)} prompts (none for prompts "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''})"))
        return generation

    def end_turn(self, active: list[int], budget: dict[int, int], stepping: list[int],
                 j: int, ids: list[int], logprobs: list[float], reason: str) -> None:
        """The engine's response `j` to the call for trajectories `active` (each cut to its `budget` of
        tokens), as soon as it is final: the trajectory is finished at a token limit, or added to
        `stepping`, the trajectories whose environment steps next."""
        i = active[j]
        traj, keep = self.trajectories[i], budget[i]
        traj.turns += 1
        traj.add(ids[:keep], logprobs[:keep])
        traj.last_turn = ids[:keep]
        if len(ids) > keep or (reason == "length" and keep < self.max_new_tokens):
            self.finish(i, "max_tokens")
        elif reason == "length":
            self.finish(i, "length")
        else:
            stepping.append(i)
            if traj.turns >= self.max_turns:  # whatever the step says, no turn follows
                self.last_turn_known(i)

    def step_environments(self, stepping: list[int], workers: EnvWorkers) -> StepResults:
        """The environment steps of the trajectories `stepping` on their last turns: inline for environments
        that return at once (`steps_inline`), the others concurrently on `workers`."""
        eos_id = self.tokenizer.eos_token_id
        texts = {i: _turn_text(self.tokenizer, self.trajectories[i].last_turn, eos_id) for i in stepping}
        results = StepResults()
        self.run_steps({i: partial(self.envs[i].step, text) for i, text in texts.items()}, workers, results)
        while again := [i for i, why in results.failures.items() if why == "env_error" and self.retries_left(i)]:
            for i in again:
                del results.failures[i]
                self.trajectories[i].env_retries += 1
            self.run_steps({i: partial(self.step_anew, i, texts[i]) for i in again}, workers, results)
        for i, step in results.steps.items():
            self.trajectories[i].stepped.append((texts[i], step))
        return results

    def run_steps(self, steps: dict[int, Callable[[], Step]], workers: EnvWorkers, results: StepResults) -> None:
        """`steps` (trajectory index -> its environment step) into `results`: inline for environments that
        return at once (`steps_inline`), the others concurrently on `workers`."""
        inline = {i: step for i, step in steps.items() if getattr(self.envs[i], "steps_inline", False)}
        for i, step in inline.items():
            try:
                results.steps[i] = step()
            except Exception as e:  # noqa: BLE001 - a broken environment ends its trajectory, not the run
                results.raised(i, e)
        threaded = {i: step for i, step in steps.items() if i not in inline}
        if threaded:
            _step_all(workers.pool(), threaded, self.trajectories, self.limits, results)

    def retries_left(self, i: int) -> bool:
        return self.new_env is not None and self.trajectories[i].env_retries < self.limits.retries

    def step_anew(self, i: int, text: str) -> Step:
        """Trajectory `i`'s step on `text`, on a fresh environment given the trajectory's earlier turns again."""
        env = self.envs[i] = self.new_env()
        env.reset(*self.rows[i])
        for turn, (earlier, step) in enumerate(self.trajectories[i].stepped, start=1):
            replayed = env.step(earlier)
            if (replayed.observation, replayed.done) != (step.observation, step.done):
                raise RuntimeError(f"a fresh environment answers turn {turn} otherwise than the first one did "
                                   "(an environment that is not deterministic cannot be replayed)")
        return env.step(text)

    def answer_steps(self, stepping: list[int], results: StepResults) -> list[int]:
        """Each stepped trajectory ended (its step failed, said done, or its turns or tokens are spent) or
        given its observation; returns the trajectories that take another turn, in order."""
        active = []
        for i in stepping:
            traj = self.trajectories[i]
            if i in results.failures:
                self.finish(i, results.failures[i])
                continue
            step = results.steps[i]
            traj.tool_calls += step.tool_calls
            self.add_reward(traj, step.reward)
            if step.done:
                self.finish(i, "stop")
            elif traj.turns >= self.max_turns:
                self.finish(i, "max_turns")
            else:
                obs = self.observations.ids([step.observation] if isinstance(step.observation, str)
                                            else list(step.observation))
                if self.limits.max_tokens is not None and len(traj.response_ids) + len(obs) > self.limits.max_tokens:
                    self.finish(i, "max_tokens")  # no room to answer the observation
                else:
                    traj.add(obs, None)
                    active.append(i)
        return active

    def add_reward(self, traj: Trajectory, reward) -> None:
        """A step's reward onto its trajectory's. One that is not a real, finite number (NaN, inf, a string;
        a bool counts as 0 or 1, as in the reward terms) fails the trajectory's environment reward, which
        stays 0 whatever later steps return."""
        if reward is None or traj.env_reward_failure is not None:
            return
        if isinstance(reward, numbers.Real) and math.isfinite(reward):
            traj.env_reward += float(reward)
            return
        traj.env_reward = 0.0
        traj.env_reward_failure = (f"env.name ({self.limits.name}): a step returned reward {reward!r:.80} "
                                   f"({type(reward).__name__}), not a finite number")


def _tokens_left(traj: Trajectory, limits: EnvConfig, max_new_tokens: int) -> int:
    if limits.max_tokens is None:
        return max_new_tokens
    return min(max_new_tokens, limits.max_tokens - len(traj.response_ids))


def _turn_text(tokenizer, ids: list[int], eos_id: int) -> str:
    """The turn as text for the environment: special tokens kept (Llama 3's <|python_tag|> is one), the
    stop token left out."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] == eos_id else ids, skip_special_tokens=False)


def _step_all(pool: ThreadPoolExecutor, steps: dict[int, Callable[[], Step]], trajectories: list[Trajectory],
              limits: EnvConfig, results: StepResults) -> None:
    """Every trajectory's environment step, concurrently, into `results`: trajectory index -> its Step,
    or its failure ("tool_time", "env_error") when it did not return one in time. A step's clock starts
    when a pool thread picks it up, so waiting for a free thread is not charged to it."""
    started: dict[int, float] = {}

    def timed(i: int, step: Callable[[], Step]) -> Step:
        started[i] = time.monotonic()
        return step()

    limit = {i: min(limits.tool_timeout_s, limits.max_tool_time_s - trajectories[i].tool_time_s) for i in steps}
    pending: dict[Future, int] = {pool.submit(timed, i, step): i for i, step in steps.items()}
    while pending:
        now = time.monotonic()
        # Sleep until the next deadline of a running step, or a poll interval while some still wait for a thread.
        waits = [started[i] + limit[i] - now for i in pending.values() if i in started]
        if len(waits) < len(pending):
            waits.append(_POLL_S)
        done, _ = wait(pending, timeout=max(0.0, min(waits)), return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for future in done:
            i = pending.pop(future)
            trajectories[i].tool_time_s += now - started[i]
            try:
                results.steps[i] = future.result()
            except Exception as e:  # noqa: BLE001 - a broken environment ends its trajectory, not the run
                results.raised(i, e)
        for future, i in list(pending.items()):
            if i in started and now - started[i] >= limit[i]:
                del pending[future]
                trajectories[i].tool_time_s += now - started[i]
                results.failures[i] = "tool_time"
