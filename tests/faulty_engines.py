"""Rollout engines with a fault injected into their weight pushes: small wrappers around a real engine.

`SkippingEngine` silently skips one tensor of its pushes; `StuckEngine` stops taking pushes after the first.
Run as a script, this is `megarl train` whose rollout engine is a StuckEngine (test_engine_faults.py):

    faulty_engines.py ignored RECIPE [key=value ...]   pushes never take effect: version and weights stay
    faulty_engines.py claimed RECIPE [key=value ...]   the version advances, the weights stay
"""

from __future__ import annotations

import sys


class SkippingEngine:
    """A real engine whose pushes from the `start`-th (1-based) on silently skip tensor `name`: it keeps its own
    value, as a loader that ignores a name leaves it; every other tensor loads and the version advances."""

    def __init__(self, engine, *, name: str, start: int):
        self.engine, self.name, self.start, self.pushes = engine, name, start, 0

    def update_weights(self, buckets, *, version: int) -> None:
        self.pushes += 1
        if self.pushes >= self.start:
            held = dict(self.engine.read_weights([self.name]))[self.name].clone()
            buckets = ([(n, held if n == self.name else t) for n, t in bucket] for bucket in buckets)
        self.engine.update_weights(buckets, version=version)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class StuckEngine:
    """A real engine whose pushes stop taking effect after the first (which hands it the weights it started from):
    it reads every bucket and keeps its weights, and its version too unless it `claims` the pushed one."""

    def __init__(self, engine, *, claims: bool):
        self.engine, self.claims, self.pushes = engine, claims, 0

    def update_weights(self, buckets, *, version: int) -> None:
        self.pushes += 1
        if self.pushes == 1:
            return self.engine.update_weights(buckets, version=version)
        for _ in buckets:
            pass
        if self.claims:
            self.engine.weight_version = version

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


if __name__ == "__main__":
    import megarl.loops.colocated as colocated
    from megarl.cli import main

    fault, argv = sys.argv[1], sys.argv[2:]
    make = colocated.make_rollout_engine
    colocated.make_rollout_engine = lambda *a, **k: StuckEngine(make(*a, **k), claims=fault == "claimed")
    main(["train", *argv])
