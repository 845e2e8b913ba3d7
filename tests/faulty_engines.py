"""Rollout engines with a fault injected: small wrappers around a real engine.

`SkippingEngine` silently skips one tensor of its pushes; `StuckEngine` stops taking pushes after the first;
`CrashingEngine` fails generate calls midway, as a model forward that raises; `ShortEngine` leaves a prompt
unanswered without raising (the faults themselves are megarl.inject's, which a recipe's `faults` fire by step;
these count the process's generate calls). Run as a script, this is
`megarl train` whose rollout engine carries the fault (test_engine_faults.py):

    faulty_engines.py ignored RECIPE [key=value ...]   pushes never take effect: version and weights stay
    faulty_engines.py claimed RECIPE [key=value ...]   the version advances, the weights stay
    faulty_engines.py crash:N RECIPE [key=value ...]   the process's N-th generate call fails midway, once
    faulty_engines.py crash:N+ RECIPE [key=value ...]  every generate call from the N-th on fails midway
    faulty_engines.py short:N RECIPE [key=value ...]   the N-th generate call answers every prompt but its last
    faulty_engines.py kill:N RECIPE [key=value ...]    SGLang: the N-th generate call SIGKILLs the engine's
                                                       scheduler process first

With CRASH_LOG set, every generate call of a CrashingEngine appends a line there: the call's number, whether it
failed, the engine's weight version and the prompts (ids) it was given.
"""

from __future__ import annotations

import json
import os
import sys

from megarl import inject


class SkippingEngine:
    """A real engine whose pushes from the `start`-th (1-based) on silently skip tensor `name`: it keeps its own
    value, as a loader that ignores a name leaves it; every other tensor loads and the version advances."""

    def __init__(self, engine, *, name: str, start: int):
        self.engine, self.name, self.start, self.pushes = engine, name, start, 0

    def update_weights(self, buckets, *, version: int, expected: dict | None = None) -> None:
        self.pushes += 1
        if self.pushes >= self.start:
            held = dict(self.engine.read_weights([self.name]))[self.name].clone()
            buckets = ([(n, held if n == self.name else t) for n, t in bucket] for bucket in buckets)
        return self.engine.update_weights(buckets, version=version, expected=expected)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class StuckEngine:
    """A real engine whose pushes stop taking effect after the first (which hands it the weights it started from):
    it reads every bucket and keeps its weights, and its version too unless it `claims` the pushed one."""

    def __init__(self, engine, *, claims: bool):
        self.engine, self.claims, self.pushes = engine, claims, 0
        # "keeps its weights": they stay on the device through every release (released ones would come back as
        # garbage, which the engine itself refuses to generate from: a fault of another kind)
        engine.keeps_weights = True

    def device_bytes(self) -> dict[str, int]:
        return {}  # these tests are about the checks of a push; the weights it keeps are not in the plan

    def update_weights(self, buckets, *, version: int, expected: dict | None = None) -> None:
        self.pushes += 1
        if self.pushes == 1:
            return self.engine.update_weights(buckets, version=version, expected=expected)
        for _ in buckets:
            pass
        if self.claims:
            self.engine.weight_version = version

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class CrashingEngine:
    """A real engine whose generate calls `crashes(n)` selects (n counts the calls of every CrashingEngine of
    the process, from 1) hand out their first half of responses and then raise, as a model forward that hits
    a device error would. The engine is dead afterwards: every later call raises too, until it is replaced."""

    calls = 0  # over the process

    def __init__(self, engine, *, crashes):
        self.engine, self.crashes, self.dead = engine, crashes, False

    def generate(self, prompts, *, on_response=None, **kwargs):
        CrashingEngine.calls += 1
        n = CrashingEngine.calls
        faulty = self.faulty(n)
        self._log(n, faulty, prompts)
        if not faulty:
            return self.engine.generate(prompts, on_response=on_response, **kwargs)
        return self.fail(n, prompts, on_response, **kwargs)

    def faulty(self, n: int) -> bool:
        """Whether call `n` carries the fault."""
        return self.dead or self.crashes(n)

    def fail(self, n: int, prompts, on_response, **kwargs):
        """Call `n`, with the fault."""
        self.dead = True
        return inject.crash_midway(self.engine, prompts, on_response, what=f"generate call {n}", **kwargs)

    def _log(self, n: int, crash: bool, prompts) -> None:
        if path := os.environ.get("CRASH_LOG"):
            with open(path, "a") as f:
                f.write(json.dumps({"call": n, "crash": crash, "version": self.engine.weight_version,
                                    "prompts": prompts}) + "\n")

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class ShortEngine(CrashingEngine):
    """A real engine whose generate calls `crashes(n)` selects return normally without a response for their
    last prompt, as an engine that loses a request would: nothing raised, one sample missing."""

    def faulty(self, n: int) -> bool:
        return self.crashes(n)

    def fail(self, n: int, prompts, on_response, **kwargs):
        return inject.answer_all_but_last(self.engine, prompts, on_response, **kwargs)


class SchedulerKiller(CrashingEngine):
    """An SGLang engine whose scheduler process is SIGKILLed at the start of the calls `crashes(n)` selects,
    before they reach it: the engine fails as SGLang fails. (Killed at a call's first response instead, the
    scheduler may have finished the whole batch by then, and the death shows only at the next push.)"""

    def faulty(self, n: int) -> bool:
        return self.crashes(n)

    def fail(self, n: int, prompts, on_response, **kwargs):
        inject.kill_scheduler(self.engine)
        return self.engine.generate(prompts, on_response=on_response, **kwargs)


def crashes(spec: str):
    """`N`: the N-th call only; `N+`: every call from the N-th on."""
    first = int(spec.rstrip("+"))
    return (lambda n: n >= first) if spec.endswith("+") else (lambda n: n == first)


if __name__ == "__main__":
    import megarl.loops.colocated as colocated
    import megarl.loops.split_worker as split_worker
    from megarl.cli import main

    fault, argv = sys.argv[1], sys.argv[2:]
    make = colocated.make_rollout_engine
    if fault.startswith(("crash:", "kill:", "short:")):
        kind, spec = fault.split(":")
        wrapper, which = {"crash": CrashingEngine, "kill": SchedulerKiller, "short": ShortEngine}[kind], crashes(spec)
        faulty = lambda *a, **k: wrapper(make(*a, **k), crashes=which)  # noqa: E731
    else:
        faulty = lambda *a, **k: StuckEngine(make(*a, **k), claims=fault == "claimed")  # noqa: E731
    for module in (colocated, split_worker):  # where each placement makes its engines
        if not hasattr(module, "make_rollout_engine"):
            sys.exit(f"faulty_engines.py: {module.__name__} makes no rollout engines any more; patch where it does")
        module.make_rollout_engine = faulty
    main(["train", *argv])
