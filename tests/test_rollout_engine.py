"""megarl.rollout.engine: both rollout engines implement the written interface the RL loop calls, with the
same keyword arguments, and megarl.rollout.backends picks them by `rollout.engine`."""

from __future__ import annotations

import inspect

import pytest

from megarl.rollout.engine import RolloutEngine

PROTOCOL_METHODS = sorted(name for name, value in vars(RolloutEngine).items()
                          if callable(value) and not name.startswith("_"))


def engine_classes():
    from megarl.rollout.native import NativeEngine
    from megarl.rollout.sglang_engine import SGLangEngine  # imports no SGLang until an engine starts

    return [NativeEngine, SGLangEngine]


def test_the_protocol_lists_what_the_loop_calls():
    assert PROTOCOL_METHODS == ["abandon", "flush_cache", "generate", "read_weights", "release_memory",
                                "resume_cache", "resume_weights", "rng_state", "set_rng_state", "shutdown",
                                "update_weights"]


@pytest.mark.parametrize("cls", engine_classes(), ids=lambda c: c.__name__)
def test_each_engine_implements_every_method_with_the_protocol_arguments(cls):
    for name in PROTOCOL_METHODS:
        assert name in vars(cls), f"{cls.__name__} has no {name}"
        want = inspect.signature(getattr(RolloutEngine, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert [(p.name, p.kind) for p in got.values()] == [(p.name, p.kind) for p in want.values()], name


def test_a_native_engine_is_a_rollout_engine(qwen2_dir):
    from megarl.config import RolloutConfig
    from megarl.rollout.backends import make_rollout_engine

    engine = make_rollout_engine(RolloutConfig(engine="native"), str(qwen2_dir), dtype="float32", seed=0)
    assert isinstance(engine, RolloutEngine)
    assert engine.weight_version == 0


def test_the_protocol_check_can_fail():
    class Partial:
        weight_version = 0

        def generate(self, prompts):
            return None

    assert not isinstance(Partial(), RolloutEngine)
