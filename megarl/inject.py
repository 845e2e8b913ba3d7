"""Faults injected on purpose, to show what a run survives: the recipe's `faults` list, which
tools/fault_matrix.py and the tests set (docs/faults.md). A real run leaves it empty; then `arm` installs
nothing and every hook below returns after looking at an empty list.

A fault fires once per run, in step `step` (counted as the loop counts, from 1), on the global rank `rank` (every
rank when null), at the first hook of its kind in that step. It leaves a mark in RUN_DIR/faults/fired, so the
run a launcher restarts after it (torchrun --max-restarts, a requeue) goes on without it:

    kill          the process is SIGKILLed at `phase` (a dead node, the kernel's OOM killer)
    sigterm       the process is sent SIGTERM at `phase` (a preemption, a job time limit)
    hang          the process stops at `phase` and never goes on (a hung device): its peers wait in a collective
    nan           the policy loss is NaN (the rank's advantages are)
    disk_full     the step's checkpoint write fails with ENOSPC after the models are written
    engine_crash  the step's first generate call hands out half its responses, then raises (a device error)
    engine_short  the step's first generate call returns without a response for its last prompt
    engine_kill   SGLang: the engine's scheduler process is SIGKILLed as the step's first generate call starts (on
                  the first rank of node k >= 1 of an engine over whole nodes: that node's first scheduler, as the
                  step's first round of generation starts)
    env_error     the step's first environment step raises
    reward_kill   the step's first sample scored kills the process scoring it (a reward worker; needs
                  reward.workers > 0, or the trainer itself would be the process killed)
    reward_hang   the step's first sample scored never returns (its scorer's time limits end it)
    sandbox_hang  scoring the step's first sample runs a program that never exits in the code sandbox
                  (megarl.rewards.sandbox, its wall_s 2 s): the sample fails with what the sandbox did

A rollout rank of placement split runs no steps: its engine faults fire at its `step`-th generate call.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from megarl.config import FaultConfig, SandboxConfig

log = logging.getLogger(__name__)

_armed: list[FaultConfig] = []  # this rank's faults not fired yet
_step = 0  # the step the loop is in (a rollout rank: its generate calls)
_rank = 0
_marks = Path("faults")  # RUN_DIR/faults: the marks of faults fired, and of those scored in another process


def arm(faults: list[FaultConfig], *, rank: int, run_dir: str) -> None:
    """Install this rank's faults of the recipe (`faults`) that have not fired in this run yet; a process calls
    it once, before its first step."""
    global _marks, _rank
    _marks, _rank = Path(run_dir) / "faults", rank
    _armed[:] = [f for f in faults if (f.rank is None or f.rank == rank) and not _fired(f).exists()]
    if _armed:
        log.warning("faults injected on rank %d: %s", rank, ", ".join(f"{f.kind} in step {f.step}" for f in _armed))


def enter_step(step: int) -> None:
    global _step
    _step = step


def _fired(fault: FaultConfig) -> Path:
    return _marks / "fired" / f"{fault.kind}-step{fault.step}-{fault.phase}-rank{_rank}"


def _take(kind: str, phase: str | None = None) -> bool:
    """Whether a fault of `kind` (at `phase`) fires now; it fires once."""
    for fault in _armed:
        if fault.kind == kind and fault.step == _step and (phase is None or fault.phase == phase):
            _armed.remove(fault)
            _fired(fault).parent.mkdir(parents=True, exist_ok=True)
            _fired(fault).touch()
            log.warning("fault injected: %s in step %d%s", kind, _step, f" at {phase}" if phase else "")
            return True
    return False


# ---- the loop's hooks -------------------------------------------------------------------------------------
def at(phase: str) -> None:
    """The process faults of `phase` in this step: kill, sigterm, hang."""
    if not _armed:
        return
    if _take("kill", phase):
        os.kill(os.getpid(), signal.SIGKILL)
    if _take("sigterm", phase):
        os.kill(os.getpid(), signal.SIGTERM)  # handled as a real one: megarl.loops.stop
    if _take("hang", phase):
        while True:
            time.sleep(3600)


def poison(advantages):  # [B] -> [B]
    """The advantages, all NaN when a `nan` fault fires in this step."""
    return advantages * float("nan") if _armed and _take("nan") else advantages


def checkpoint_written(path: Path) -> None:
    """Called once a checkpoint's models are written to `path`: a `disk_full` fault fails the write there."""
    if _armed and _take("disk_full"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# ---- engines -------------------------------------------------------------------------------------------------
def crash_midway(engine, prompts, on_response, *, what: str, **kwargs):
    """A generate call that hands out the responses of its first half of `prompts`, then raises, as a model
    forward that hits a device error would."""
    half = len(prompts) // 2

    def respond(i, *response):
        if i < half and on_response is not None:
            on_response(i, *response)

    engine.generate(prompts[:half], on_response=respond, **kwargs)
    raise RuntimeError(f"simulated device failure in {what}")


def answer_all_but_last(engine, prompts, on_response, **kwargs):
    """A generate call that returns normally without a response for its last prompt, as an engine that loses
    a request would: nothing raised, one sample missing."""
    last = len(prompts) - 1

    def respond(i, *response):
        if i != last and on_response is not None:
            on_response(i, *response)

    return engine.generate(prompts, on_response=respond, **kwargs)


def kill_scheduler(engine) -> None:
    """SIGKILL an SGLang engine's scheduler (TP rank 0's, which comes first) and wait until it is gone, so the
    call that follows meets a dead engine as SGLang does."""
    scheduler = engine.engine.get_all_child_pids()[0]
    os.kill(scheduler, signal.SIGKILL)
    while not _gone(scheduler):
        time.sleep(0.01)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in next((line for line in f if line.startswith("State:")), "").lower()
    except OSError:
        return True


class FaultyEngine:
    """A real engine whose generate call carries the engine faults armed for its step."""

    def __init__(self, engine, *, counts_calls: bool):
        self.engine, self.counts_calls, self.calls = engine, counts_calls, 0

    def generate(self, prompts, *, on_response=None, **kwargs):
        self.calls += 1
        if self.counts_calls:
            enter_step(self.calls)
            at("generate")
        if _take("engine_crash"):
            return crash_midway(self.engine, prompts, on_response, what=f"step {_step}'s generate call", **kwargs)
        if _take("engine_short"):
            return answer_all_but_last(self.engine, prompts, on_response, **kwargs)
        if _take("engine_kill"):
            kill_scheduler(self.engine)
        return self.engine.generate(prompts, on_response=on_response, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def node_part(node) -> None:
    """The step's first round of generation on the first rank of node k >= 1 of an engine over whole nodes
    (megarl.rollout.sglang_launch.SGLangNodePart): an armed `engine_kill` SIGKILLs the node's first scheduler,
    which the engine's host meets in its generate call (a dead TP rank)."""
    if _take("engine_kill"):
        kill_scheduler(node)


def engine(made, *, counts_calls: bool = False):
    """`made`, or made carrying this rank's engine faults where any are armed. `counts_calls`: a rollout rank
    of placement split, whose faults (its process faults at "generate" too) fire at its `step`-th generate call."""
    if any(f.kind.startswith("engine_") for f in _armed) or (counts_calls and _armed):
        return FaultyEngine(made, counts_calls=counts_calls)
    return made


# ---- environments and rewards -----------------------------------------------------------------------------
def environments(new_env: Callable):
    """`new_env`, or a maker of environments whose step raises when an `env_error` fault fires."""
    if not any(f.kind == "env_error" for f in _armed):
        return new_env

    def make():
        env = new_env()
        step = env.step

        def faulty_step(turn: str):
            if _take("env_error"):
                raise RuntimeError(f"simulated environment failure in step {_step}")
            return step(turn)

        env.step = faulty_step
        return env

    return make


def reward_mark() -> str | None:
    """A mark for the first sample handed to the scorer in a step whose `reward_*` fault fires: a file whose
    first taker, the process that scores the sample (in a Ray worker too), is killed or hangs. A retry of the
    sample finds the mark taken and scores it."""
    for kind in ("reward_kill", "reward_hang", "sandbox_hang"):
        if _armed and _take(kind):
            mark = _marks / f"{kind}-step{_step}-pid{os.getpid()}"
            mark.touch()
            return str(mark)
    return None


def score_marked(mark: str, *, run_sandboxed: Callable) -> None:
    """Called before a sample that carries a mark (reward_mark) is scored; `run_sandboxed` is the code sandbox's
    run_python (megarl.rewards.sandbox), for sandbox_hang."""
    try:
        os.unlink(mark)  # one taker
    except FileNotFoundError:
        return
    if Path(mark).name.startswith("reward_kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if Path(mark).name.startswith("sandbox_hang"):
        result = run_sandboxed("import time\ntime.sleep(10**6)\n", SandboxConfig(wall_s=2.0))
        ended = "killed at the sandbox's wall_s" if result.returncode is None else f"exit {result.returncode}"
        raise RuntimeError(f"a program that never exits ran in the code sandbox ({result.mode}): {ended}")
    while True:
        time.sleep(3600)
