"""The GPU memory choreography, run on the CPU: the trainer's state leaves with its storage really freed while
the rollout engine generates and comes back bit for bit; checkpoints read it only when it is resident; every
rank waits for the rollout engines to give their memory back before any trainer model is built."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, run_python
from test_engine import fixed_tokens, response_mask

RUN_TIMEOUT_S = 240


def engine_of(model_dir, groups, *, train: bool, distributed: bool = True):
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine

    optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=distributed) if train else None
    return TrainEngine(model_dir=str(model_dir), dtype="float32", megatron={}, groups=groups, optim=optim)


def loss_fn(logprobs, mb):
    loss = -(logprobs * mb["response_mask"]).sum() / mb["response_mask"].sum()
    return loss, {"loss": loss.detach()}


def resident_bytes(engine) -> dict[str, int]:
    """Bytes each kind of trainer state holds now, each storage once: parameters, gradient buffers, and the
    optimizer's own tensors (its fp32 parameters when they are not the model's, its moments)."""
    memory = engine.memory
    storages = lambda tensors: {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}  # noqa: E731
    params = storages(memory._param_tensors())
    grads = storages(b.grad_data for b in memory._buffers() if b.grad_data is not None) if memory.ddps else {}
    opt = storages(memory._optimizer_tensors()) if memory.optimizer is not None else {}
    opt = {k: v for k, v in opt.items() if k not in params}
    return {kind: sum(s.nbytes() for s in found.values())
            for kind, found in (("params", params), ("grads", grads), ("optim", opt))}


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed_optimizer", "plain_optimizer"])
def test_offload_frees_the_storage_and_onload_brings_back_the_same_training(qwen2_dir, groups, distributed):
    tokens, mask = fixed_tokens(), response_mask(fixed_tokens())
    step = dict(temperature=1.0, micro_batch_size=2)
    moved, stayed = (engine_of(qwen2_dir, groups, train=True, distributed=distributed) for _ in range(2))
    for engine in (moved, stayed):
        engine.train_step(tokens, {"response_mask": mask}, loss_fn, **step)  # the optimizer now has state
    before = resident_bytes(moved)
    n_params = sum(p.numel() for p in moved.module.parameters())
    # fp32 parameters and gradients; Adam's two moments (the main parameters are the model's own in fp32)
    assert before["params"] >= 4 * n_params and before["grads"] >= 4 * n_params and before["optim"] >= 8 * n_params

    freed = moved.offload_training_state()
    assert resident_bytes(moved)["grads"] == resident_bytes(moved)["optim"] == 0  # every optimizer tensor left
    assert resident_bytes(moved)["params"] == before["params"]  # the push still reads them
    freed += moved.offload_params()
    assert resident_bytes(moved) == {"params": 0, "grads": 0, "optim": 0}
    # each storage once: an fp32 optimizer's parameters are the model's own (or views of its buffer)
    assert freed == moved.memory.offloaded_bytes == sum(before.values())

    moved.onload()
    assert resident_bytes(moved) == before and moved.memory.offloaded_bytes == 0
    assert torch.equal(moved.logprobs(tokens, **step), stayed.logprobs(tokens, **step))
    # the next update is the same to the bit: moments, main parameters and zeroed gradients all came back
    got, want = (e.train_step(tokens, {"response_mask": mask}, loss_fn, **step) for e in (moved, stayed))
    assert got == want
    for a, b in zip(moved.module.parameters(), stayed.module.parameters()):
        assert torch.equal(a, b)


def test_a_frozen_model_offloads_its_parameters_and_host_buffers_are_kept(qwen2_dir, groups):
    engine = engine_of(qwen2_dir, groups, train=False)
    tokens = fixed_tokens()
    want = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    assert engine.offload_training_state() == 0  # nothing to free: no gradients, no optimizer
    nbytes = engine.offload_params()
    assert nbytes == sum(p.numel() * 4 for p in engine.module.parameters())
    assert engine.offload_params() == 0  # already parked
    hosts = {k: h.data_ptr() for k, h in engine.memory._hosts.items()}
    engine.onload()
    engine.offload_params()
    assert {k: h.data_ptr() for k, h in engine.memory._hosts.items()} == hosts  # the same host buffers, reused
    engine.onload()
    assert torch.equal(engine.logprobs(tokens, temperature=1.0, micro_batch_size=2), want)
