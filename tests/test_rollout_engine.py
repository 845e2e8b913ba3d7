"""megarl.rollout.engine: both rollout engines implement the written interface the RL loop calls, with the
same keyword arguments, and megarl.rollout.backends picks them by `rollout.engine`."""

from __future__ import annotations

import inspect

import pytest
import torch

from megarl.rollout.engine import RolloutEngine

PROTOCOL_METHODS = sorted(name for name, value in vars(RolloutEngine).items()
                          if callable(value) and not name.startswith("_"))


def engine_classes():
    from megarl.rollout.native import NativeEngine
    from megarl.rollout.sglang_engine import SGLangEngine  # imports no SGLang until an engine starts

    return [NativeEngine, SGLangEngine]


def test_the_protocol_lists_what_the_loop_calls():
    assert PROTOCOL_METHODS == ["abandon", "device_bytes", "flush_cache", "generate", "read_weights", "release_memory",
                                "resume_cache", "resume_weights", "rng_state", "set_rng_state", "shutdown",
                                "update_adapter", "update_weights"]


@pytest.mark.parametrize("cls", engine_classes(), ids=lambda c: c.__name__)
def test_each_engine_implements_every_method_with_the_protocol_arguments(cls):
    for name in PROTOCOL_METHODS:
        assert name in vars(cls), f"{cls.__name__} has no {name}"
        want = inspect.signature(getattr(RolloutEngine, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert [(p.name, p.kind) for p in got.values()] == [(p.name, p.kind) for p in want.values()], name


def test_a_native_engine_is_a_rollout_engine(qwen2_dir):
    from megarl.config import RolloutConfig
    from megarl.models.arch import read_shape
    from megarl.rollout.backends import make_rollout_engine

    engine = make_rollout_engine(RolloutConfig(engine="native"), str(qwen2_dir), shape=read_shape(qwen2_dir),
                                 dtype="float32", seed=0)
    assert isinstance(engine, RolloutEngine)
    assert engine.weight_version == 0


def test_the_protocol_check_can_fail():
    class Partial:
        weight_version = 0

        def generate(self, prompts):
            return None

    assert not isinstance(Partial(), RolloutEngine)


def _pinning_in_a_child(queue) -> None:
    import os

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from megarl.rollout.sglang_plugin import cpu_pinning

    cpu_pinning()
    t = torch.ones(3)
    queue.put((torch.zeros(2, pin_memory=True).tolist(), t.pin_memory() is t,
               torch.tensor([1.0, 2.0], pin_memory=True).tolist()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where there is a CUDA device")
def test_the_sglang_plugin_makes_pinning_a_no_op_in_sglangs_cpu_processes_only():
    """megarl's SGLang plugin (run by SGLang in each of its processes, found through megarl's entry points):
    in a process multiprocessing started (SGLang's scheduler) in CPU mode, page-locking is a no-op, so SGLang's
    LoRA layers can be built; the process that starts the engine (a trainer rank) keeps torch as it is."""
    import multiprocessing
    import os
    from importlib.metadata import entry_points

    from megarl.rollout import sglang_plugin

    assert "megarl.rollout.sglang_plugin:cpu_pinning" in [ep.value for ep in entry_points(group="sglang.srt.plugins")]
    with pytest.raises(RuntimeError):  # what SGLang's LoRA layers meet on a CPU-only machine
        torch.zeros(2, pin_memory=True)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_pinning_in_a_child, args=(queue,))
    child.start()
    assert queue.get(timeout=60) == ([0.0, 0.0], True, [1.0, 2.0])
    child.join(timeout=30)
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        sglang_plugin.cpu_pinning()  # in this (main) process: nothing changes
    finally:
        del os.environ["SGLANG_USE_CPU_ENGINE"]
    assert not sglang_plugin._applied
    with pytest.raises(RuntimeError):
        torch.zeros(2, pin_memory=True)
