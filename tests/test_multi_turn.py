"""Multi-turn rollouts: token in, token out, and the scheduler's limits.

The trajectory the trainer gets is exactly the prompt, the generated ids and the tokenized observations, its
loss mask is 1 on generated ids only, and Megatron's logprobs on it equal the rollout engine's on every
generated id. The single_turn environment reproduces the plain rollout token for token. The scheduler ends
each trajectory by the limit it reached, without one slow tool holding up the others.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time

import pytest
import torch

from conftest import REPO
from megarl.batch import pack_sequences
from megarl.config import Config, DataConfig, EnvConfig, ModelConfig, RolloutConfig
from megarl.envs.environment import environment_factory
from megarl.envs.tool_format import ObservationFormat
from megarl.envs.trajectories import run_trajectories
from megarl.rollout.engine import Generation
from megarl.rollout.native import NativeEngine


@pytest.fixture(scope="module")
def tool_chat_dir(tmp_path_factory):
    """A random tiny tool-chat model (EOS <|im_end|>): near-uniform next-token distributions, so a turn of
    up to 100 tokens ends with EOS about half of the time and trajectories of several turns occur."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_model(tmp_path_factory.mktemp("tool_chat"), tool_chat=True, seed=3)


def make_run(model_dir, groups, engine, *, env: EnvConfig, max_new_tokens: int, chat_template: bool):
    """The parts of an RLRun that generate() reads, around a real engine (colocated, on this rank)."""
    from transformers import AutoTokenizer

    from megarl.config import RewardConfig
    from megarl.envs.tool_format import observation_format
    from megarl.job import Job
    from megarl.loops.colocated import ColocatedRollouts
    from megarl.loops.rl_run import RLRun
    from megarl.rewards.scorer import Scorer
    from megarl.routing import RoutePlan

    cfg = Config(model=ModelConfig(path=str(model_dir)), data=DataConfig(train_path="unused.jsonl",
                                                                          chat_template=chat_template),
                 # no restarts: these runs have no trainer to push the weights again (EngineLost at once)
                 rollout=RolloutConfig(max_new_tokens=max_new_tokens, max_engine_restarts=0), env=env)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    new_env = environment_factory(env)
    rollouts = ColocatedRollouts(Job.of(cfg, world=1, ranks_per_node=1), groups)  # one engine, on this rank
    rollouts.engine = engine
    return RLRun(cfg=cfg, groups=groups, tokenizer=tokenizer, train_rows=[], eval_rows=[], sampler=None,
                 actor=None, reference=None, critic=None, rollouts=rollouts, prompts_per_rank=0, objective=None,
                 critic_objective=None, routes=RoutePlan("none", on_policy=True), advantages=None, kl=None,
                 scorer=Scorer(RewardConfig()), reward_models=[],
                 new_env=new_env,
                 tool_schemas=new_env().tools, observations=observation_format(env, tokenizer))


def rows(n: int, **metadata):
    from megarl.data.prompts import PromptRow

    return [PromptRow(prompt=f"{10 + i}*{20 + i}=", answer=str((10 + i) * (20 + i)), index=i, metadata=dict(metadata))
            for i in range(n)]


def test_single_turn_environment_reproduces_the_plain_rollout(qwen2_dir, groups):
    from megarl.data.prompts import encode_prompt
    from megarl.loops.colocated import generate

    run = make_run(qwen2_dir, groups, NativeEngine(str(qwen2_dir), seed=7), env=EnvConfig(),
                   max_new_tokens=12, chat_template=False)
    batch = generate(run, run.rollouts, rows(6), n_samples=2).batch
    # the rollout as it is without environments: one engine call, responses packed after their prompts
    plain = NativeEngine(str(qwen2_dir), seed=7)
    prompts = [encode_prompt(run.tokenizer, r.prompt, chat_template=False) for r in rows(6) for _ in range(2)]
    gen = plain.generate(prompts, temperature=1.0, top_p=1.0, max_new_tokens=12, eos_id=run.tokenizer.eos_token_id,
                         pad_id=run.tokenizer.pad_token_id)
    tokens, mask, logprobs = pack_sequences(prompts, gen.response_ids, gen.logprobs, pad_id=run.tokenizer.pad_token_id)
    assert torch.equal(batch.tokens, tokens)
    assert torch.equal(batch.response_mask, mask)
    assert torch.equal(batch.rollout_logprobs, logprobs)
    assert batch.responses == [run.tokenizer.decode(r, skip_special_tokens=True) for r in gen.response_ids]
    assert batch.finish_reasons == gen.finish_reasons
    assert batch.prompt_lens.tolist() == [len(p) for p in prompts]
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert batch.turns.tolist() == [1] * 12 and batch.tool_calls.tolist() == [0] * 12
    assert batch.env_rewards.tolist() == [0.0] * 12


class RecordingEngine:
    """The native engine, with every response it generated kept, per context, to check the batch against."""

    def __init__(self, engine: NativeEngine):
        self.engine, self.generated = engine, {}

    def generate(self, prompts, **kwargs) -> Generation:
        gen = self.engine.generate(prompts, **kwargs)
        for prompt, ids, logprobs in zip(prompts, gen.response_ids, gen.logprobs):
            self.generated[tuple(prompt)] = (ids, logprobs)
        return gen

    def __getattr__(self, name: str):  # the rest of the interface is the engine's
        return getattr(self.engine, name)


def test_trajectory_is_generated_then_observation_tokens_and_the_trainer_scores_them(tool_chat_dir, groups):
    from megarl.algo.advantages import grpo_advantages
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.data.prompts import encode_prompt
    from megarl.loops.colocated import generate
    from megarl.objective import advantage_fn

    engine = RecordingEngine(NativeEngine(str(tool_chat_dir), seed=0))
    env = EnvConfig(name="envs_for_tests:CountingEnv", max_turns=3, max_tokens=240)
    run = make_run(tool_chat_dir, groups, engine, env=env, max_new_tokens=100, chat_template=True)
    # distinct prompts: each context identifies its trajectory
    batch = generate(run, run.rollouts, rows(16), n_samples=1).batch
    fmt = ObservationFormat(run.tokenizer)
    eos = run.tokenizer.eos_token_id
    multi_turn = 0
    for i in range(len(batch)):
        # rebuild the trajectory from what the engine generated and the environment said, turn by turn
        prompt = encode_prompt(run.tokenizer, batch.prompt_texts[i], chat_template=True)
        expected, generated_mask, logprobs = list(prompt), [], []
        for turn in range(int(batch.turns[i])):
            ids, lps = engine.generated[tuple(expected)]
            left = 240 - (len(expected) - len(prompt))  # env.max_tokens cuts the turn that reaches it
            ids, lps = ids[:left], lps[:left]
            expected += ids
            generated_mask += [1] * len(ids)
            logprobs += lps
            if turn + 1 < batch.turns[i]:
                assert ids[-1] == eos  # only a turn that ended with the stop token gets an observation
                obs = fmt.ids([f"obs {turn + 1}"])
                expected += obs
                generated_mask += [0] * len(obs)
                logprobs += [0.0] * len(obs)
        n = len(expected)
        assert batch.tokens[i, :n].tolist() == expected
        assert (batch.tokens[i, n:] == run.tokenizer.pad_token_id).all()
        padding = [0.0] * (batch.tokens.shape[1] - n)
        assert batch.response_mask[i].tolist() == [0.0] * len(prompt) + generated_mask + padding
        assert torch.equal(batch.rollout_logprobs[i, len(prompt):n], torch.tensor(logprobs))
        assert batch.tool_calls[i] == batch.turns[i] if batch.finish_reasons[i] == "max_turns" else True
        assert batch.finish_reasons[i] in ("length", "max_turns", "max_tokens")  # CountingEnv is never done
        assert n - len(prompt) <= 240
        multi_turn += int(batch.turns[i]) > 1
    assert multi_turn >= 4, batch.turns  # the check above covered observations inside responses
    assert "max_turns" in batch.finish_reasons

    # The trainer, unchanged: Megatron's logprobs on the generated ids equal the engine's (fp32, contract 2),
    # which holds only if every generated id sits where it was sampled, after the observation tokens.
    actor = TrainEngine(model_dir=str(tool_chat_dir), shape=read_shape(str(tool_chat_dir)), dtype="float32", megatron={}, groups=groups)
    old = actor.logprobs(batch.tokens, temperature=1.0, micro_batch_size=8) * batch.response_mask
    assert (old - batch.rollout_logprobs).abs().max() <= 1e-4
    # Group advantages (groups of four trajectories here) reach every generated token of a trajectory and
    # no observation token.
    batch = dataclasses.replace(batch, group_ids=torch.arange(len(batch)) // 4)
    batch = batch.replace(rewards=torch.arange(len(batch), dtype=torch.float32) % 3, old_logprobs=old)
    advantages, _ = advantage_fn(run.cfg.algo, group=None)(batch, 0.0)
    per_sample = grpo_advantages(batch.rewards, batch.group_ids, std_norm=True)
    assert torch.equal(advantages, torch.where(batch.response_mask.bool(), per_sample[:, None], 0.0))


# ---- the scheduler ----------------------------------------------------------------------------------------------
class ScriptedEngine:
    """An engine whose every turn is `turn_ids` then EOS (logprob -0.5 each), cut at max_new_tokens, for
    scheduler tests where what the model says must be fixed."""

    def __init__(self, turn_ids: list[int]):
        self.turn_ids, self.calls = turn_ids, []

    def generate(self, prompts, *, temperature, top_p, max_new_tokens, eos_id, pad_id, on_response) -> Generation:
        self.calls.append(len(prompts))
        full = self.turn_ids + [eos_id]
        ids = full[:max_new_tokens]
        reason = "stop" if len(ids) == len(full) else "length"
        for i in range(len(prompts)):
            on_response(i, list(ids), [-0.5] * len(ids), reason)
        return Generation([list(ids) for _ in prompts], [[-0.5] * len(ids) for _ in prompts], [reason] * len(prompts))


@pytest.fixture(scope="module")
def tool_tokenizer(tool_chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_chat_dir)


def trajectories_of(tokenizer, env: EnvConfig, metadata: list[dict], *, turn_ids=(30, 31, 32), max_new_tokens=10,
                    on_last_turn=None):
    new_env = environment_factory(env)
    engine = ScriptedEngine(list(turn_ids))
    out = run_trajectories(engine, [[1, 40, 41] for _ in metadata], [new_env() for _ in metadata],
                           [("p", m) for m in metadata], tokenizer=tokenizer, observations=ObservationFormat(tokenizer),
                           limits=env, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens,
                           on_last_turn=on_last_turn)
    return out, engine


def test_a_tool_past_its_limit_ends_its_trajectory_and_the_others_finish(tool_tokenizer):
    env = EnvConfig(name="envs_for_tests:SleepyEnv", tool_timeout_s=0.5)
    start = time.monotonic()
    out, engine = trajectories_of(tool_tokenizer, env, [{"sleep_s": 3.0}, {}, {"sleep_s": 0.1}, {}])
    elapsed = time.monotonic() - start
    assert [t.finish_reason for t in out] == ["tool_time", "stop", "stop", "stop"]
    assert [t.turns for t in out] == [1, 2, 2, 2]
    assert engine.calls == [4, 3]  # the slow trajectory left the batch; the others went on together
    assert 0.5 <= out[0].tool_time_s < 1.0
    # the others waited for the slow tool no longer than its 0.5 s limit (not its 3 s), plus scheduling slack
    assert elapsed < 2.0, elapsed


def test_limits_end_trajectories_and_are_recorded(tool_tokenizer):
    # max_turns: the third turn still calls a tool
    out, _ = trajectories_of(tool_tokenizer, EnvConfig(name="envs_for_tests:CountingEnv", max_turns=3), [{}])
    assert out[0].finish_reason == "max_turns" and out[0].turns == 3 and out[0].tool_calls == 3
    # max_tokens: a turn is 4 tokens and an observation 11 ("obs N" in the tool-response markup); 4 + 11 + 4
    # fit in 20, the next observation does not, and nothing is appended past the limit
    obs_len = len(ObservationFormat(tool_tokenizer).ids(["obs 1"]))
    limit = 4 + obs_len + 4 + 1
    out, _ = trajectories_of(tool_tokenizer, EnvConfig(name="envs_for_tests:CountingEnv", max_tokens=limit), [{}])
    assert out[0].finish_reason == "max_tokens" and out[0].turns == 2
    assert len(out[0].response_ids) == 4 + obs_len + 4 <= limit
    # a turn budget cut by max_tokens: the turn is cut to what is left and the trajectory ends there
    cut = EnvConfig(name="envs_for_tests:CountingEnv", max_tokens=4 + obs_len + 2)
    out, _ = trajectories_of(tool_tokenizer, cut, [{}])
    assert out[0].finish_reason == "max_tokens" and len(out[0].response_ids) == 4 + obs_len + 2
    assert out[0].generated_mask == [1] * 4 + [0] * obs_len + [1] * 2
    # length: a turn that reaches rollout.max_new_tokens without the stop token ends the trajectory
    out, _ = trajectories_of(tool_tokenizer, EnvConfig(name="envs_for_tests:CountingEnv"), [{}], max_new_tokens=3)
    assert out[0].finish_reason == "length" and out[0].turns == 1
    # env_error: an environment that raises ends its own trajectory only
    out, _ = trajectories_of(tool_tokenizer, EnvConfig(name="envs_for_tests:SleepyEnv"), [{"raise": "boom"}, {}])
    assert [t.finish_reason for t in out] == ["env_error", "stop"]
    # the tool-time budget of a trajectory: two steps of 0.3 s do not fit in 0.5 s
    out, _ = trajectories_of(tool_tokenizer, EnvConfig(name="envs_for_tests:SleepyEnv", max_tool_time_s=0.5),
                             [{"sleep_s": 0.3}])
    assert out[0].finish_reason == "tool_time" and out[0].turns == 2
    # step rewards add up over the trajectory
    out, _ = trajectories_of(tool_tokenizer, EnvConfig(name="envs_for_tests:CountingEnv", max_turns=2,
                                                       options={"reward_per_step": 0.25}), [{}])
    assert out[0].env_reward == 0.5


def test_an_environment_that_steps_inline_runs_on_the_rollouts_own_thread(tool_tokenizer):
    """`steps_inline` (the built-in single_turn declares it): the steps run on the calling thread, not in the
    worker pool, and a step that raises still ends its own trajectory only."""
    import threading

    from envs_for_tests import InlineEnv

    InlineEnv.threads.clear()
    out, engine = trajectories_of(tool_tokenizer, EnvConfig(name="envs_for_tests:InlineEnv"), [{"raise": "boom"}, {}])
    assert [t.finish_reason for t in out] == ["env_error", "stop"] and [t.turns for t in out] == [1, 2]
    assert engine.calls == [2, 1]
    assert InlineEnv.threads == [threading.get_ident()] * 3  # the failed step, then both steps of the other
    assert environment_factory(EnvConfig())().steps_inline


@pytest.mark.parametrize("env, metadata, max_new_tokens, expected", [
    # single_turn: handed out as the engine returns the turn, before its step says "stop"
    (EnvConfig(), [{}, {}], 10, [(0, 1, ""), (1, 1, "")]),
    # the last turn allowed: handed out before its step, whatever that step says
    (EnvConfig(name="envs_for_tests:CountingEnv", max_turns=2), [{}], 10, [(0, 2, "")]),
    # a turn cut at max_new_tokens ends the trajectory at once
    (EnvConfig(name="envs_for_tests:CountingEnv"), [{}], 3, [(0, 1, "length")]),
    # otherwise the step decides: a failed step, and a step that says done on the second turn
    (EnvConfig(name="envs_for_tests:SleepyEnv"), [{"raise": "boom"}, {}], 10, [(0, 1, "env_error"), (1, 2, "stop")]),
])
def test_a_trajectory_is_handed_out_once_as_soon_as_its_last_turn_is_known(tool_tokenizer, env, metadata,
                                                                            max_new_tokens, expected):
    handed = []

    def on_last_turn(i, trajectory):  # what the trajectory is at that moment
        handed.append((i, trajectory.turns, trajectory.finish_reason, list(trajectory.response_ids)))

    out, _ = trajectories_of(tool_tokenizer, env, metadata, max_new_tokens=max_new_tokens, on_last_turn=on_last_turn)
    assert sorted((i, turns, reason) for i, turns, reason, _ in handed) == expected
    for i, _, _, response_ids in handed:
        assert response_ids == out[i].response_ids  # the response was final when it was handed out


def scored_batch(tokenizer, env: EnvConfig, metadata: list[dict], *, n_samples: int):
    """The samples of one generate_part call (ScriptedEngine turns, `env`, one row per metadata), scored by a
    reward term that gives 1.0, packed and rewarded as a training rank does: (batch, failures, scorer)."""
    from types import SimpleNamespace

    from megarl.config import RewardConfig, RewardTermConfig
    from megarl.data.prompts import PromptRow
    from megarl.loops.samples import build_batch, generate_part, with_rewards
    from megarl.rewards.scorer import Scorer

    cfg = Config(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"),
                 rollout=RolloutConfig(max_new_tokens=10), env=env)
    scorer = Scorer(RewardConfig(terms=[RewardTermConfig(kind="custom", function="reward_fns:fails_on_bad")]))
    ctx = SimpleNamespace(cfg=cfg, tokenizer=tokenizer, scorer=scorer, new_env=environment_factory(env),
                          tool_schemas=[], observations=ObservationFormat(tokenizer), env_workers=None)
    samples = [(PromptRow(prompt="p", answer="a", index=i, metadata=m), [1, 40, 41]) for i, m in enumerate(metadata)]
    trajectories, scoring = generate_part(ctx, ScriptedEngine([30, 31, 32]), samples)
    rewards, failures, _ = scoring.result()
    batch = build_batch(tokenizer, [row for row, _ in samples], [ids for _, ids in samples], trajectories,
                        engines=[0] * len(samples), n_samples=n_samples)
    batch = with_rewards(batch, torch.tensor(rewards), reward_models=[], micro_batch_size=8,
                         pad_id=tokenizer.pad_token_id)
    return batch, failures, scorer


def test_a_nan_step_reward_fails_its_sample_and_never_reaches_the_advantages(tool_tokenizer, caplog):
    """A step reward that is not a finite number fails its sample as a failing reward term does: the sample
    scores 0 (its terms' 1.0 and the environment's reward alike), counts as a failure (reward/failed_frac),
    and the warning names the environment; the group's advantages, loss and gradient stay finite."""
    import logging

    from megarl.algo.advantages import broadcast_to_tokens, grpo_advantages
    from megarl.algo.aggregate import LossNorm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    env = EnvConfig(name="envs_for_tests:CountingEnv", max_turns=2, options={"reward_per_step": math.nan})
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
        batch, failures, scorer = scored_batch(tool_tokenizer, env, [{}] * 4, n_samples=4)
    assert batch.env_rewards.tolist() == [0.0] * 4 and batch.rewards.tolist() == [0.0] * 4
    assert failures == 4
    reason = "env.name (envs_for_tests:CountingEnv): a step returned reward nan (float), not a finite number"
    assert scorer.first_failure.startswith(reason)
    [record] = caplog.records
    assert "4 of 4 rewards failed" in record.message and reason in record.message
    advantages = broadcast_to_tokens(grpo_advantages(batch.rewards, batch.group_ids), batch.response_mask)
    assert torch.equal(advantages, torch.zeros_like(advantages))
    mask = batch.response_mask
    logprobs = batch.rollout_logprobs.clone().requires_grad_(True)
    mb = {"response_mask": mask, "old_logprobs": batch.rollout_logprobs, "advantages": advantages}
    norm = LossNorm(tokens=float(mask.sum()), seqs=float(len(batch)), max_len=mask.shape[1])
    loss, _ = policy_objective(AlgoConfig())(logprobs, mb, norm=norm)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_step_rewards_that_are_not_finite_numbers_fail_only_their_own_samples(tool_tokenizer):
    # two groups of three; the failed samples score 0, the others 1.0 (the term) plus their step reward
    step_rewards = [math.nan, 0.5, "1.0", math.inf, None, True]
    batch, failures, scorer = scored_batch(tool_tokenizer, EnvConfig(name="envs_for_tests:StepRewardEnv"),
                                           [{"step_reward": r} for r in step_rewards], n_samples=3)
    assert failures == 3
    assert batch.rewards.tolist() == [0.0, 1.5, 0.0, 0.0, 1.0, 2.0]
    assert batch.env_rewards.tolist() == [0.0, 0.5, 0.0, 0.0, 0.0, 1.0]
    assert scorer.first_failure.startswith("env.name (envs_for_tests:StepRewardEnv): a step returned reward nan")
    from megarl.algo.advantages import grpo_advantages
    assert torch.isfinite(grpo_advantages(batch.rewards, batch.group_ids)).all()


class RoutedEngine(ScriptedEngine):
    """ScriptedEngine that also returns MoE routes: every row of call k's routes holds k."""

    def generate(self, prompts, **kwargs) -> Generation:
        generation = super().generate(prompts, **kwargs)
        call = len(self.calls)
        routes = [torch.full((len(p) + len(r) - 1, 1, 1), call, dtype=torch.uint8)
                  for p, r in zip(prompts, generation.response_ids)]
        return dataclasses.replace(generation, routes=routes)


def test_a_trajectory_keeps_the_routes_of_its_last_call_and_the_batch_cuts_them_to_its_tokens(tool_tokenizer):
    from megarl.loops.samples import batch_routes

    env = EnvConfig(name="envs_for_tests:CountingEnv", max_turns=2)
    prompt = [1, 40, 41]
    out = run_trajectories(RoutedEngine([30, 31, 32]), [prompt], [environment_factory(env)()], [("p", {})],
                           tokenizer=tool_tokenizer, observations=ObservationFormat(tool_tokenizer), limits=env,
                           temperature=1.0, top_p=1.0, max_new_tokens=10)
    traj = out[0]
    assert traj.turns == 2
    # the second call fed the first turn and its observation as prompt: its routes cover the whole trajectory
    assert traj.routes.shape[0] == len(prompt) + len(traj.response_ids) - 1 and bool((traj.routes == 2).all())
    # a trajectory ended by its token budget: the batch's routes still end at its last token but one
    obs_len = len(ObservationFormat(tool_tokenizer).ids(["obs 1"]))
    cut = EnvConfig(name="envs_for_tests:CountingEnv", max_tokens=4 + obs_len + 2)
    out = run_trajectories(RoutedEngine([30, 31, 32]), [prompt], [environment_factory(cut)()], [("p", {})],
                           tokenizer=tool_tokenizer, observations=ObservationFormat(tool_tokenizer), limits=cut,
                           temperature=1.0, top_p=1.0, max_new_tokens=10)
    assert out[0].finish_reason == "max_tokens"
    routes, = batch_routes([prompt], out)
    assert routes.shape[0] == len(prompt) + len(out[0].response_ids) - 1
    # without routes from the engine, the batch has none
    assert batch_routes([prompt], trajectories_of(tool_tokenizer, env, [{}])[0]) is None


class FailingEngine(ScriptedEngine):
    """A ScriptedEngine whose `fail_call`-th generate call hands out the first half of its responses and then
    raises, as a model forward that hits a device error would."""

    def __init__(self, turn_ids: list[int], *, fail_call: int):
        super().__init__(turn_ids)
        self.fail_call = fail_call

    def generate(self, prompts, *, on_response, **kwargs) -> Generation:
        if len(self.calls) + 1 != self.fail_call:
            return super().generate(prompts, on_response=on_response, **kwargs)
        half = len(prompts) // 2
        super().generate(prompts[:half], on_response=on_response, **kwargs)
        self.calls.pop()  # a failed call returned nothing: not counted
        raise RuntimeError("device lost")


def test_a_failed_engine_call_is_undone_and_a_new_engine_goes_on_from_the_last_finished_turn(tool_tokenizer):
    """Two-turn trajectories (CountingEnv, max_turns 2): the engine fails its second call (the last turns) after
    handing out half of them. Those responses are dropped and withdrawn from the scoring, the environments saw
    nothing of the call, and a new engine generates the second turns of all four: the trajectories, the
    environments' records and the rewards equal a run without the failure, each sample scored once."""
    from types import SimpleNamespace

    from megarl.config import RewardConfig, RewardTermConfig
    from megarl.data.prompts import PromptRow
    from megarl.loops.samples import EnginePart
    from megarl.rewards.scorer import Scorer
    from megarl.rollout.engine import EngineError

    env = EnvConfig(name="envs_for_tests:CountingEnv", max_turns=2, options={"reward_per_step": 0.25})

    def part():
        cfg = Config(model=ModelConfig(path="unused"), data=DataConfig(train_path="unused.jsonl"),
                     rollout=RolloutConfig(max_new_tokens=10), env=env)
        scorer = Scorer(RewardConfig(terms=[RewardTermConfig(kind="custom", function="reward_fns:fails_on_bad")]))
        envs: list = []

        def new_env():
            envs.append(environment_factory(env)())
            return envs[-1]

        ctx = SimpleNamespace(cfg=cfg, tokenizer=tool_tokenizer, scorer=scorer, new_env=new_env, tool_schemas=[],
                              observations=ObservationFormat(tool_tokenizer), env_workers=None)
        samples = [(PromptRow(prompt="p", answer="a", index=i, metadata={}), [1, 40, 41 + i]) for i in range(4)]
        return EnginePart(ctx, samples), envs

    clean, clean_envs = part()
    assert clean.run(ScriptedEngine([30, 31, 32])) is None
    expected, expected_scoring = clean.result()

    faulted, envs = part()
    withdrawn = []
    rollout = faulted.trajectories.rollout
    rollout.on_retract = lambda i, withdraw=rollout.on_retract: (withdrawn.append(i), withdraw(i))
    failing = FailingEngine([30, 31, 32], fail_call=2)
    error = faulted.run(failing)
    assert isinstance(error, EngineError) and error.phase == "generate" and "RuntimeError: device lost" in str(error)
    assert failing.calls == [4]  # the failed call is not counted: it returned nothing
    assert withdrawn == [0, 1]  # the two last turns it handed out before failing
    assert [t.turns for t in faulted.trajectories.trajectories] == [1] * 4  # back to the first turn
    assert [len(e.turns) for e in envs] == [1] * 4  # no environment stepped on the failed call's turns
    fresh = ScriptedEngine([30, 31, 32])
    assert faulted.run(fresh) is None
    assert fresh.calls == [4]  # every second turn, once
    got, scoring = faulted.result()
    for mine, theirs in zip(got, expected):
        assert (mine.response_ids, mine.generated_mask, mine.logprobs, mine.turns, mine.finish_reason,
                mine.env_reward) == (theirs.response_ids, theirs.generated_mask, theirs.logprobs, theirs.turns,
                                     theirs.finish_reason, theirs.env_reward)
    assert [e.turns for e in envs] == [e.turns for e in clean_envs]
    assert scoring.result() == expected_scoring.result()  # a sample handed in twice would have raised


# ---- environments that raise: tried again on a fresh environment (env.retries) -----------------------------
def retried(tokenizer, metadata: list[dict], *, retries: int = 2, max_turns: int = 3):
    """run `TrajectoryRun` with FlakyEnv environments made anew on failure: (trajectories, engine calls)."""
    from envs_for_tests import FlakyEnv

    from megarl.envs.trajectories import TrajectoryRun

    FlakyEnv.made[0] = 0
    env = EnvConfig(name="envs_for_tests:FlakyEnv", max_turns=max_turns, retries=retries)
    new_env = environment_factory(env)
    FlakyEnv.made[0] = 0  # the factory made one to check it
    engine = ScriptedEngine([30, 31, 32])
    run = TrajectoryRun([[1, 40, 41] for _ in metadata], [new_env() for _ in metadata], [("p", m) for m in metadata],
                        tokenizer=tokenizer, observations=ObservationFormat(tokenizer), limits=env, temperature=1.0,
                        top_p=1.0, max_new_tokens=10, new_env=new_env)
    return run.run(engine), engine


def test_a_step_that_raises_goes_on_in_a_fresh_environment_that_replays_the_earlier_turns(tool_tokenizer):
    """Environment 0 (of trajectory 0) raises at turn 2; environment 2, made for it, replays turn 1 and answers
    turn 2 and 3. The trajectory is the one a fault-free run makes, token for token, and counts one retry."""
    clean, _ = retried(tool_tokenizer, [{}, {}])
    out, engine = retried(tool_tokenizer, [{"raise_at": {"0": 2}}, {}])
    assert [t.finish_reason for t in out] == ["max_turns", "max_turns"]
    assert [t.env_retries for t in out] == [1, 0]
    assert [t.response_ids for t in out] == [t.response_ids for t in clean]
    assert [t.tool_calls for t in out] == [t.tool_calls for t in clean] == [3, 3]
    assert engine.calls == [2, 2, 2]


def test_retries_end_with_env_error_after_env_retries_fresh_environments(tool_tokenizer):
    """Environments 0, 2 and 3 (the first one of trajectory 0 and both fresh ones made for it) raise at their
    turn 2: the trajectory ends with env_error after 2 retries; the other goes on. No retry: at once."""
    out, _ = retried(tool_tokenizer, [{"raise_at": {"0": 2, "2": 2, "3": 2}}, {}])
    assert [(t.finish_reason, t.env_retries, t.turns) for t in out] == [("env_error", 2, 2), ("max_turns", 0, 3)]
    out, _ = retried(tool_tokenizer, [{"raise_at": {"0": 2}}, {}], retries=0)
    assert [(t.finish_reason, t.env_retries) for t in out] == [("env_error", 0), ("max_turns", 0)]


def test_a_fresh_environment_that_answers_an_earlier_turn_otherwise_cannot_take_over(tool_tokenizer, caplog):
    """Each environment answers in its own words: the replay of turn 1 differs, so no fresh one can go on in
    the failed one's place, and the trajectory ends with env_error, naming why."""
    out, _ = retried(tool_tokenizer, [{"raise_at": {"0": 2}, "shuffled": True}])
    assert (out[0].finish_reason, out[0].env_retries) == ("env_error", 2)
    assert "answers turn 1 otherwise than the first one did" in caplog.text
