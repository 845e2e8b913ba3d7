"""The GPU memory choreography, run on the CPU: the trainer's state leaves with its storage really freed while
the rollout engine generates and comes back bit for bit; checkpoints read it only when it is resident; every
rank waits for the rollout engines to give their memory back before any trainer model is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_python
from test_engine import fixed_tokens, response_mask

RUN_TIMEOUT_S = 240


def engine_of(model_dir, groups, *, train: bool, distributed: bool = True):
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    optim = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=distributed) if train else None
    return TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="float32", megatron={}, groups=groups, optim=optim)


def loss_fn(logprobs, mb):
    loss = -(logprobs * mb["response_mask"]).sum() / mb["response_mask"].sum()
    return loss, {"loss": loss.detach()}


def resident_bytes(engine) -> dict[str, int]:
    """Bytes each kind of trainer state holds now, each storage once: parameters, gradient buffers, and the
    optimizer's own tensors (its fp32 parameters when they are not the model's, its moments)."""
    memory = engine.memory
    storages = lambda tensors: {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}  # noqa: E731
    params = storages(memory._param_tensors())
    grads = storages(memory._grad_tensors()) if memory.ddps else {}
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
    # every step parks into the same host buffers (pinned ones, on a GPU): none is allocated again
    hosts = {key: host.data_ptr() for key, host in moved.memory._hosts.items()}
    moved.offload_training_state() + moved.offload_params()
    assert {key: host.data_ptr() for key, host in moved.memory._hosts.items()} == hosts
    moved.onload()


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


# ---- start-up order ------------------------------------------------------------------------------------------
# Rank 0 hosts the one engine of rollout.tp = 2, whose release of its memory is slow here; each rank records
# when it starts building its first trainer model, and rank 0 when its engine gave the memory back.
STARTUP_WORKER = """
import json, os, sys, time
from megarl.cli import main
from megarl.engine import roles
from megarl.loops import colocated

events = {}
make_rollout_engine, make_engine = colocated.make_rollout_engine, roles.make_engine

def slow_release(*args, **kwargs):
    engine = make_rollout_engine(*args, **kwargs)
    release = engine.release_memory
    def release_memory():
        time.sleep(3)
        release()
        events.setdefault("released", time.time())
    engine.release_memory = release_memory
    return engine

def first_model(*args, **kwargs):
    events.setdefault("first_model", time.time())
    return make_engine(*args, **kwargs)

colocated.make_rollout_engine, roles.make_engine = slow_release, first_model
try:
    main(sys.argv[1:])
finally:
    with open(f"{sys.argv[-1].split('=', 1)[1]}/events{os.environ['RANK']}.json", "w") as f:
        json.dump(events, f)
"""


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_no_rank_builds_a_trainer_model_before_every_engine_gave_its_memory_back(qwen2_dir, arithmetic_dir,
                                                                                  tmp_path):
    """An SGLang engine's TP schedulers size their KV cache from the memory free on every device of the group,
    so the rank beside the engine's host must not allocate a model there until the engine has released."""
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(
        f"model:\n  path: {qwen2_dir}\n"
        f"data:\n  train_path: {arithmetic_dir / 'train.jsonl'}\n  prompts_per_step: 2\n"
        "rollout:\n  n_samples: 2\n  max_new_tokens: 2\n  tp: 2\n"
        "train:\n  steps: 1\n  micro_batch_size: 2\n"
        "algo:\n  name: grpo\n"
        "reward:\n  terms:\n    - {kind: length_penalty, max_tokens: 2, cache_tokens: 1}\n"
        "log:\n  progress: false\n")
    worker = tmp_path / "worker.py"
    worker.write_text(STARTUP_WORKER)
    run_dir = tmp_path / "run"
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker), "train",
                       str(recipe), f"run_dir={run_dir}"], cwd=tmp_path, timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    host, beside = (json.loads((run_dir / f"events{rank}.json").read_text()) for rank in (0, 1))
    assert "released" not in beside  # one engine, on rank 0
    assert beside["first_model"] >= host["released"], (beside, host)


def test_the_warm_start_gives_back_all_of_its_engine_before_the_rollout_engines_start(qwen2_dir, arithmetic_dir,
                                                                                    groups, tmp_path, monkeypatch):
    """The rollout engines size their memory from what is free when they start, right after the warm start:
    its model, gradients and optimizer state must be gone by then. Dropping the engine is not enough: Megatron's
    DDP hooks hold it in reference cycles through autograd's C++ nodes, which the garbage collector never
    breaks (measured: the model outlives gc.collect())."""
    from transformers import AutoTokenizer

    from megarl.config import load_config
    from megarl.data.prompts import load_prompts
    from megarl.engine import roles
    from megarl.job import Job
    from megarl.loops import warmup

    cfg = load_config(REPO / "recipes" / "quickstart.yaml", [
        f"model.path={qwen2_dir}", f"data.train_path={arithmetic_dir / 'train.jsonl'}", "data.eval_path=null",
        f"run_dir={tmp_path / 'run'}", "warmup.sft_steps=2", "warmup.batch_size=4", "train.micro_batch_size=4"])
    built = []
    make_engine = roles.make_engine
    monkeypatch.setattr(roles, "make_engine", lambda *a, **k: built.append(make_engine(*a, **k)) or built[-1])
    rows = load_prompts(cfg.data.train_path, prompt_key="prompt", answer_key="answer")[:64]
    out = warmup.sft_warmup(Job.of(cfg, world=1, ranks_per_node=1), groups, AutoTokenizer.from_pretrained(qwen2_dir),
                            rows)
    assert (Path(out) / "model.safetensors").is_file()  # exported first
    (engine,) = built
    assert resident_bytes(engine) == {"params": 0, "grads": 0, "optim": 0}
