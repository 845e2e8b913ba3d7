"""LoRA on the policy (`model.lora`, Hu et al. 2021): low-rank adapters on the linear layers of every transformer
layer, the base weights frozen.

- Adapters are built into Megatron's local layer spec (megarl.engine.lora_layers), split over tensor-parallel
  ranks like the layers they wrap; their parameters are the only ones that require gradients, so DDP makes
  gradient buffers and the (distributed) optimizer holds state for them alone.
- A is drawn per adapter from the run's seed and the adapter's global name, whole, then cut to this rank's
  shard: the same adapters at every parallel layout. B starts at zero, so a fresh policy is the base model.
- The base model is the policy with its adapters off (`adapters_off`; megarl.engine.roles.BasePolicy): the
  reference policy of a LoRA run is the actor's own engine, not a second model.
- What leaves the trainer as HF weights (the push to the rollout engines, the HF export) is the merged weight
  W + (alpha / rank) B A, computed on each rank's shards before they are gathered (megarl.engine.hf_weights).
- Checkpoints hold the adapters and their optimizer state; the frozen base is read from model.path again.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.config import LoraConfig
from megarl.models import layout

ADAPTER_PARAMS = ("lora_a", "lora_b")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` (any prefix) is an adapter factor."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def adapt_layer_spec(layer_spec, lora: LoraConfig) -> None:
    """Swap the targeted linears of a local transformer-layer spec for their adapted versions (in place)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megarl.engine.lora_layers import AdapterShape, LoraColumnParallelLinear, LoraRowParallelLinear

    adapter = AdapterShape(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
    attention = layer_spec.submodules.self_attention.submodules
    mlp = layer_spec.submodules.mlp.submodules
    # a MoE layer's MLPs: every expert's (SequentialMLP builds each from one spec) and the shared experts'
    mlps = [mlp] if not hasattr(mlp, "experts") else \
        [spec.submodules for spec in (mlp.experts, mlp.shared_experts) if spec is not None]
    column = dict(module=LoraColumnParallelLinear, params={"adapter": adapter})
    row = dict(module=LoraRowParallelLinear, params={"adapter": adapter})
    for target in lora.targets:
        match target:
            case "qkv":
                attention.linear_qkv = ModuleSpec(**column)
            case "proj":
                attention.linear_proj = ModuleSpec(**row)
            case "fc1":
                for each in mlps:
                    each.linear_fc1 = ModuleSpec(module=LoraColumnParallelLinear,
                                                 params={"adapter": adapter, "gate_up": True})
            case "fc2":
                for each in mlps:
                    each.linear_fc2 = ModuleSpec(**row)


def freeze_base(chunks: list) -> int:
    """Only adapter factors require gradients; returns how many parameters train."""
    trained = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad_(is_adapter(name))
            trained += param.numel() if is_adapter(name) else 0
    return trained


def init_adapters(layers: Iterator[tuple[str, torch.nn.Module]], *, seed: int, tp_rank: int, tp_size: int,
                  etp_rank: int = 0, etp_size: int = 1, expert_offset: int = 0) -> None:
    """A of every adapted layer (global module name, layer) drawn whole from U(-1/sqrt(in), 1/sqrt(in)) (PEFT's and
    torch's default for a linear of that fan-in) with a generator seeded by `seed` and the name, then cut to this
    rank's shard (row-parallel layers split A on its input dim: over the tensor-parallel ranks, a routed expert's
    over the expert tensor-parallel ones, `etp_rank` of `etp_size`); B zero. An expert's name carries its global
    index (`expert_offset`: this rank's first expert), so every expert-parallel layout draws the same A."""
    with torch.no_grad():
        for name, layer in layers:
            expert = _is_expert(name)
            rank, size = (etp_rank, etp_size) if expert else (tp_rank, tp_size)
            name = _global_expert(name, expert_offset)
            split = getattr(layer.lora_a, "partition_dim", None) if getattr(layer.lora_a, "tensor_model_parallel",
                                                                             False) else None
            adapter_rank, fan_in = layer.lora_a.shape
            fan_in *= size if split == 1 else 1
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1 / math.sqrt(fan_in)
            full = torch.empty(adapter_rank, fan_in).uniform_(-bound, bound, generator=gen)
            layer.lora_a.copy_(layout.shard(full, dim=split, rank=rank, size=size))
            layer.lora_b.zero_()


def _is_expert(name: str) -> bool:
    """Whether module `name` is one of a routed expert's linears (`...mlp.experts.local_experts.{i}...`)."""
    return "local_experts" in name.split(".")


def _global_expert(name: str, offset: int) -> str:
    """`...experts.local_experts.{i}...` -> the same with i + offset (any other name as it is)."""
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if part == "local_experts":
            parts[k + 1] = str(int(parts[k + 1]) + offset)
    return ".".join(parts)


@contextmanager
def adapters_off(chunks: list):
    """Within: every adapted layer of `chunks` computes its base weight alone (the base model)."""
    layers = [m for chunk in chunks for m in chunk.modules() if hasattr(m, "adapter_on")]
    for layer in layers:
        layer.adapter_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_on = True

