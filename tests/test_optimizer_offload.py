"""optim.cpu_offload: Megatron's HybridDeviceOptimizer keeps a fraction of the optimizer state (fp32 master
weights, Adam moments) in host memory and steps it there. On this CPU-only machine it runs through
megarl.engine.cpu_compat's stand-in for its device/host split, with its own copies, hooks and steps.

Proved here, on one rank in bf16 (Megatron's offloading optimizer steps 16-bit models only), for a dense model
and gpt-oss (routed experts, sinks, biases):
- training with half or all of the state on the host is training without offload, bit for bit: losses,
  gradient norms, updated weights, master weights and moments;
- the host share is not the device's: the trainer's device count (the ledger's) holds only the device share,
  and the offload between updates neither moves nor copies the host share again;
- checkpoints resume with or without the offload, either way round, bit for bit;
- a GRPO run with all of it on the host stays within `megarl plan`'s device memory and resumes.

Tolerance: none. Both optimizers step with torch's fused AdamW kernel, which updates each element on its own
from the same fp32 master weight, gradient and moments; splitting the elements between a host and a device
optimizer changes which call updates an element, not its arithmetic. (On a GPU with Transformer Engine the
device share steps in TE's FusedAdam instead: equal to float rounding, not bit for bit.)
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from conftest import REPO, needs_cuda, run_python
from test_engine import fixed_tokens, response_mask

pytestmark = pytest.mark.timeout(300)

FP32_STATE_BYTES = 12  # per element: fp32 master weight and two fp32 Adam moments
RUN_TIMEOUT_S = 240
# What DDP's padding may add beyond the plan on the device with all of the optimizer state on the host: at most
# 64 elements (megarl.ledger.DDP_PADDING_ELEMENTS) per parameter tensor of the tiny Qwen2 in Megatron (16: the
# embedding, the final norm and 7 per layer) in its bf16 parameter and fp32 gradient buffers.
DDP_PADDING_BYTES = 64 * 16 * 6


def engine_of(model_dir, groups, cpu_offload: float):
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    optim = OptimConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0, cpu_offload=cpu_offload)
    return TrainEngine(model_dir=str(model_dir), shape=read_shape(str(model_dir)), dtype="bfloat16", megatron={},
                       groups=groups, optim=optim)


def policy_step(engine) -> dict[str, float]:
    """One update on a policy-gradient loss with advantages of both signs (gradients clipped: their norm is
    about 5 here, over optim.grad_clip 1)."""
    from megarl.algo.aggregate import global_loss_norm
    from megarl.config import AlgoConfig
    from megarl.objective import policy_objective

    tokens = fixed_tokens()
    mask = response_mask(tokens)
    extras = {"response_mask": mask, "advantages": torch.linspace(-1.0, 1.0, tokens.shape[0])[:, None] * mask}
    loss_fn = partial(policy_objective(AlgoConfig(), on_policy=True), norm=global_loss_norm(mask))
    return engine.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=2)


def megatron_optimizers(engine) -> list:
    """The distributed optimizers of an engine (one per parameter kind of a MoE model)."""
    return getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])


def optimizer_state(engine) -> dict[str, torch.Tensor]:
    """Every parameter shard's fp32 master weight, Adam moments and step count as Megatron's distributed optimizer
    reads them for a checkpoint, by parameter name: the same keys whether the state is offloaded or not."""
    names = {param: name for chunk in engine.chunks for name, param in chunk.named_parameters()}
    out = {}
    for opt in megatron_optimizers(engine):
        for param in opt.model_param_group_index_map:
            for kind, tensor in opt._get_main_param_and_optimizer_states(param).items():
                out[f"{names[param]}.{kind}"] = tensor.detach().clone()
    return out


def stepped_numel(engine) -> int:
    """Elements of the parameter shards the engine's optimizers step."""
    return sum(param.numel() for opt in megatron_optimizers(engine) for group in opt.optimizer.param_groups
               for param in group["params"])


def host_share(engine) -> tuple[int, list[torch.Tensor]]:
    """(elements the host optimizers step, the tensors they hold: host copies of the master weights, their
    moments and the host copies of the gradients)."""
    numel, tensors = 0, []
    for opt in megatron_optimizers(engine):
        hybrid = opt.optimizer
        for host in hybrid.cpu_optimizers:
            for group in host.param_groups:
                for param in group["params"]:
                    numel += param.numel()
                    tensors += [param, *(v for v in host.state[param].values() if v.dim() > 0)]
        tensors += list(hybrid.cpu_copy_map_grad.values())
    return numel, tensors


def assert_same_training(got, want) -> None:
    assert dict(got.hf_tensors()).keys() == dict(want.hf_tensors()).keys()
    wanted = dict(want.hf_tensors())
    for name, tensor in got.hf_tensors():
        assert torch.equal(tensor, wanted[name]), name
    got_state, want_state = optimizer_state(got), optimizer_state(want)
    assert got_state.keys() == want_state.keys()
    for key, tensor in got_state.items():
        assert torch.equal(tensor, want_state[key]), key


@pytest.mark.parametrize("arch", ["qwen2", "gpt_oss"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_optimizer_trains_bit_for_bit_as_the_resident_one(arch, fraction, arch_dir, groups):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    model_dir = arch_dir(arch)
    resident, offloaded = engine_of(model_dir, groups, 0.0), engine_of(model_dir, groups, fraction)
    assert all(isinstance(opt.optimizer, HybridDeviceOptimizer) for opt in megatron_optimizers(offloaded))
    # the host steps at least the fraction of the state (whole tensors, in order), the device the rest
    total = stepped_numel(resident)
    assert stepped_numel(offloaded) == total
    host_numel, _ = host_share(offloaded)
    assert fraction * total <= host_numel <= total
    assert (host_numel < total) == (fraction < 1)
    before = dict(resident.hf_tensors())
    for _ in range(3):
        assert policy_step(offloaded) == policy_step(resident)
    assert any(not torch.equal(tensor, before[name]) for name, tensor in resident.hf_tensors())  # it trained
    assert_same_training(offloaded, resident)


# On a GPU the device share steps in torch's CUDA AdamW and the host share in its CPU AdamW: the same update, rounded
# apart by an ulp of a weight at most per step. After 3 steps of lr 1e-3 the fp32 master weights (at most about 1 in
# magnitude here: ulp 1.2e-7) agree within 1e-6; the losses, computed from bf16 weights that such a difference can
# move by one bf16 ulp, within 1e-3 relative.
GPU_MASTER_ATOL = 1e-6
GPU_LOSS_RTOL = 1e-3


@needs_cuda
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_gpu_offloaded_optimizer_trains_as_the_resident_one(fraction, qwen2_dir, groups):
    """Megatron's HybridDeviceOptimizer on CUDA (its own device/host split; no megarl stand-in): the host share's
    state lives on the host, and training equals the all-device optimizer's within rounding."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    resident, offloaded = engine_of(qwen2_dir, groups, 0.0), engine_of(qwen2_dir, groups, fraction)
    assert all(isinstance(opt.optimizer, HybridDeviceOptimizer) for opt in megatron_optimizers(offloaded))
    host_numel, host_tensors = host_share(offloaded)
    assert host_numel >= fraction * stepped_numel(resident) and all(not t.is_cuda for t in host_tensors)
    for step in range(3):
        got, want = policy_step(offloaded), policy_step(resident)
        assert got["loss"] == pytest.approx(want["loss"], rel=GPU_LOSS_RTOL), step
    got_state, want_state = optimizer_state(offloaded), optimizer_state(resident)
    assert got_state.keys() == want_state.keys()
    for key, tensor in got_state.items():
        diff = (tensor.double().cpu() - want_state[key].double().cpu()).abs().max().item()
        if key.endswith("param"):
            assert diff <= GPU_MASTER_ATOL, (key, diff)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_the_host_share_is_neither_counted_nor_moved_by_the_offload(fraction, qwen2_dir, groups):
    resident, moved, stayed = (engine_of(qwen2_dir, groups, f) for f in (0.0, fraction, fraction))
    for engine in (resident, moved, stayed):
        policy_step(engine)  # the optimizers now have their moments
    total = stepped_numel(resident)
    host_numel, host_tensors = host_share(moved)
    assert resident.memory.resident_bytes()["optim"] == FP32_STATE_BYTES * total
    before = moved.memory.resident_bytes()
    # the device holds the rest of the state, and nothing more: the host share is not counted as the device's
    assert before["optim"] == FP32_STATE_BYTES * (total - host_numel)
    assert (before["optim"] == 0) == (fraction == 1.0)
    assert before["params"] == resident.memory.resident_bytes()["params"]
    assert before["grads"] == resident.memory.resident_bytes()["grads"]

    host_storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in host_tensors}
    freed = moved.offload_training_state()
    assert freed == before["grads"] + before["optim"]  # the device share leaves; the host share is not moved
    assert moved.memory.host_bytes == before["optim"]  # and not copied into another host buffer
    freed += moved.offload_params()
    assert moved.memory.resident_bytes() == {"params": 0, "grads": 0, "optim": 0}
    assert {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in host_tensors} == host_storages
    moved.onload()
    assert moved.memory.resident_bytes() == before
    assert policy_step(moved) == policy_step(stayed)
    assert_same_training(moved, stayed)


@pytest.mark.parametrize("saved, loaded", [(0.5, 0.5), (0.0, 1.0), (1.0, 0.0)])
def test_a_checkpoint_resumes_with_or_without_offload(saved, loaded, qwen2_dir, groups, tmp_path):
    """A checkpoint holds the master weights and moments whichever optimizer wrote it, and the run continues
    bit for bit after loading it into an engine with the other setting (Megatron's offloading optimizer takes
    a random dummy step before loading, which the checkpoint overwrites)."""
    writer = engine_of(qwen2_dir, groups, saved)
    policy_step(writer)
    writer.save_checkpoint(tmp_path / "step1")
    reader = engine_of(qwen2_dir, groups, loaded)
    reader.load_checkpoint(tmp_path / "step1")
    assert_same_training(reader, writer)
    for _ in range(2):
        assert policy_step(reader) == policy_step(writer)
    assert_same_training(reader, writer)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_grpo_run_offloads_around_the_host_share_and_resumes(qwen2_dir, arithmetic_dir, tmp_path):
    """The RL loop with all of the optimizer state on the host: every phase's device memory, as the ledger counts
    it against `megarl plan` on the CPU (a phase over the plan fails the run), is the plan's to within DDP's
    padding, which the plan leaves out: the host share is counted nowhere on the device. The run checkpoints
    every step and a second run resumes from its last checkpoint."""
    args = ["-m", "megarl", "train", str(REPO / "recipes" / "quickstart.yaml"), f"run_dir={tmp_path}",
            f"model.path={qwen2_dir}", "model.dtype=bfloat16", "optim.cpu_offload=1",
            f"data.train_path={arithmetic_dir / 'train.jsonl'}", "data.eval_path=null", "warmup.sft_steps=0",
            "checkpoint.every_steps=1", "log.progress=false"]
    first = run_python([*args, "train.steps=2"], timeout_s=RUN_TIMEOUT_S)
    assert first.returncode == 0, first.stderr[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for phase in ("train", "push", "rollout"):
        planned, counted = (steps[-1][f"memory/peak_{kind}_bytes/{phase}"] for kind in ("planned", "counted"))
        assert 0 <= counted - planned <= DDP_PADDING_BYTES, (phase, planned, counted)
    resumed = run_python([*args, "train.steps=3"], timeout_s=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3]
