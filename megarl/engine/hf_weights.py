"""HF checkpoints in and out of a Megatron model: each rank's shards cut from safetensors files on load, and
full HF-named tensors gathered from the shards (tensor, expert and pipeline parallel) for the weight
handoff and the HF export, one tensor at a time.

A routed expert's linears are split over the expert tensor-parallel ranks (parallel.etp), every other split
tensor over the tensor-parallel ranks (parallel.tp): the two groups differ unless etp = tp.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.device import current_device
from megarl.engine.model import StageModel, tp_split
from megarl.models import layout
from megarl.models.arch import ModelShape
from megarl.models.names import STACKED
from megarl.models.safetensors_dir import SafetensorsDir

# Parameters with one row per (padded) vocabulary entry: padded on load, truncated on export.
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
# HF sequence-classification checkpoints (reward models) name their scalar head this way.
_HF_SCORE = "score.weight"
# Fused layouts whose Megatron tensor is [gate; up], each half split separately over TP ranks.
_GATE_UP = ("gate_up", "stacked_gate_up")


def load_hf(stage: StageModel, model_dir: str | Path) -> None:
    """Copy an HF checkpoint into this rank's shards. Every Megatron parameter must be covered."""
    source = SafetensorsDir(model_dir)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            shard = hf_shard(stage, source, name, param)
            if shard is not None:
                param.copy_(shard)


def hf_shard(stage: StageModel, source: SafetensorsDir, name: str, param: Tensor) -> Tensor | None:
    """This rank's shard of parameter `name` (global layer index; shaped like `param`, which may be on the
    meta device), made from the HF tensors it is built of; None for a critic's value head the checkpoint
    has no `score.weight` for (it keeps its zeros)."""
    if stage.value_head and name == "output_layer.weight":
        return source.get(_HF_SCORE).reshape(param.shape) if _HF_SCORE in source else None
    if name == "output_layer.weight" and stage.shape.tied_embeddings:
        hf_names = ("model.embed_tokens.weight",)  # last pipeline stage's copy of tied weights
        rule_fuse, expert = None, None
    else:
        rule, _, expert = stage.names.lookup(name)
        hf_names, rule_fuse = stage.names.hf_names(name, expert_offset=stage.expert_offset), rule.fuse
    full = _fuse(stage.shape, _hf_parts(stage, source, name, hf_names, rule_fuse), rule_fuse)
    if name in VOCAB_PARAMS:
        full = _pad_rows(full, param.shape[0] * stage.groups.tp_size)
    _, rank, size = _split_axis(stage, expert=expert is not None)
    shard = layout.shard(full, dim=tp_split(name, param), rank=rank, size=size, gate_up=rule_fuse in _GATE_UP)
    if shard.shape != param.shape:
        raise ValueError(f"{source.model_dir}: {hf_names} gives shape {tuple(shard.shape)} for {name}, "
                         f"expected {tuple(param.shape)}")
    return shard


def _hf_parts(stage: StageModel, source: SafetensorsDir, name: str, hf_names: tuple[str, ...],
              fuse: str | None) -> list[Tensor]:
    """The HF tensors parameter `name` is made of; of a tensor stacking every expert of a layer, the row of this
    parameter's expert (its global index), read alone."""
    if fuse not in STACKED:
        return [source.get(n) for n in hf_names]
    _, _, expert = stage.names.lookup(name)
    return [source.get(n, row=expert + stage.expert_offset) for n in hf_names]


def _fuse(shape: ModelShape, parts: list[Tensor], fuse: str | None) -> Tensor:
    match fuse:
        case None | "stacked":
            return parts[0]
        case "stacked_gate_up":
            return layout.interleaved_to_fc1(parts[0])
        case "stacked_down":
            return layout.down_to_fc2(parts[0])
        case "qkv":
            return layout.join_qkv(*parts, groups=shape.kv_heads, head_dim=shape.head_dim)
        case "gate_up":
            return layout.join_gate_up(*parts)
    raise ValueError(f"unknown fused layout {fuse!r}")


def hf_tensors(stage: StageModel, params: Iterator[tuple[str, Tensor, Tensor]] | None = None, *,
               classifier: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Full HF-named tensors of this model, one at a time (TP shards all-gathered, a routed expert's over the
    expert tensor-parallel group, experts gathered over the expert-parallel group with their global indices).

    Every rank of a pipeline stage takes part in the gathers; every rank yields the full tensors of
    its own stage's layers, every expert included, so the rank that feeds a rollout engine must also
    receive the other stages' tensors (`pipeline_hf_tensors`).

    `params` yields (name with the global layer index, parameter, its value on this rank); by default the
    parameters' own values, a LoRA-adapted weight merged with its adapter on this rank's shard first. The
    conversion tools pass values read from a distributed checkpoint instead
    (megarl.engine.dist_checkpoint.checkpoint_params), the parameters then living on the meta device.

    `classifier` (a scalar-head model only): the HF sequence-classification layout instead, the trunk's
    tensors and the head as `score.weight` [1, hidden] (replicated over TP, so nothing is gathered). A
    scalar-head model is never exported as a causal LM, nor an LM as a classifier.
    """
    if stage.value_head != classifier:
        raise ValueError("a critic is not a causal LM: its weights have no HF causal-LM export"
                         if stage.value_head else "only a scalar-head model exports as a sequence classifier")
    ep_ranks = dist.get_process_group_ranks(stage.groups.ep)
    experts_per_rank = stage.shape.experts // stage.groups.ep_size
    if params is None:
        params = _own_values(stage)
    stacks = _ExpertStacks(stage.shape.experts)
    for name, param, data in params:
        if name == "output_layer.weight" and classifier:
            yield _HF_SCORE, data
            continue
        if name == "output_layer.weight" and stage.shape.tied_embeddings:
            continue
        rule, _, expert = stage.names.lookup(name)
        data = _gather_tp(stage, data, dim=tp_split(name, param), gate_up=rule.fuse in _GATE_UP,
                          expert=expert is not None)
        if name in VOCAB_PARAMS:
            data = data[: stage.shape.vocab_size]
        if expert is None:
            yield from zip(stage.names.hf_names(name), _split(stage.shape, data, rule.fuse))
            continue
        # Every EP rank holds this local expert slot for a different global expert: each rank in turn
        # broadcasts its copy, so no rank holds more than one extra expert tensor at a time.
        for ep_rank, src in enumerate(ep_ranks):
            copy = data
            if stage.groups.ep_size > 1:
                copy = data.contiguous() if ep_rank == stage.groups.ep_rank else torch.empty_like(data)
                dist.broadcast(copy, src=src, group=stage.groups.ep)
            hf_parts = zip(stage.names.hf_names(name, expert_offset=ep_rank * experts_per_rank),
                           _split(stage.shape, copy, rule.fuse))
            if rule.fuse not in STACKED:
                yield from hf_parts
                continue
            for hf_name, row in hf_parts:
                whole = stacks.add(hf_name, expert + ep_rank * experts_per_rank, row)
                if whole is not None:
                    yield hf_name, whole


class _ExpertStacks:
    """Experts' rows of HF tensors that stack every expert of a layer (gpt-oss), kept until a tensor is whole."""

    def __init__(self, experts: int):
        self.experts = experts
        self.rows: dict[str, dict[int, Tensor]] = {}

    def add(self, hf_name: str, expert: int, row: Tensor) -> Tensor | None:
        """Keep `row` as expert `expert` (global index) of `hf_name`; the stacked [experts, ...] tensor once
        every expert's row is in, else None."""
        rows = self.rows.setdefault(hf_name, {})
        rows[expert] = row
        if len(rows) < self.experts:
            return None
        del self.rows[hf_name]
        return torch.stack([rows[e] for e in range(self.experts)])


def _split_axis(stage: StageModel, *, expert: bool) -> tuple[dist.ProcessGroup, int, int]:
    """(group, this rank's index in it, its size) of the ranks a tensor is split over: a routed expert's
    (`expert`) the expert tensor-parallel ranks, any other the tensor-parallel ranks."""
    groups = stage.groups
    return (groups.etp, groups.etp_rank, groups.etp_size) if expert else (groups.tp, groups.tp_rank, groups.tp_size)


def _gather_tp(stage: StageModel, data: Tensor, *, dim: int | None, gate_up: bool, expert: bool) -> Tensor:
    """The full tensor of this rank's shard `data`, split on `dim` (None: every rank holds it whole) over the
    tensor-parallel ranks, or a routed expert's (`expert`) over the expert tensor-parallel ones."""
    group, _, size = _split_axis(stage, expert=expert)
    if dim is None or size == 1:
        return data
    shards = [torch.empty_like(data) for _ in range(size)]
    dist.all_gather(shards, data.contiguous(), group=group)
    return layout.unshard(shards, dim=dim, gate_up=gate_up)


def hf_adapter_tensors(stage: StageModel) -> Iterator[tuple[str, Tensor]]:
    """This stage's LoRA adapters as PEFT names them on the HF model: `base_model.model.{hf module}.lora_A.weight`
    [r, in] and `.lora_B.weight` [out, r], TP shards gathered. A fused Megatron linear (QKV, gate/up) has one A
    for its HF projections: each gets a copy, and its rows of B, which is the same update (B_q A, B_k A, ...)."""
    for layer_name, layer in stage.adapted_layers():
        name = f"{layer_name}.weight"
        rule, _, expert = stage.names.lookup(name)
        gate_up, expert = rule.fuse in _GATE_UP, expert is not None
        a = _gather_tp(stage, layer.lora_a.detach(), dim=tp_split(name, layer.lora_a), gate_up=False, expert=expert)
        b = _gather_tp(stage, layer.lora_b.detach(), dim=tp_split(name, layer.lora_b), gate_up=gate_up,
                       expert=expert)
        for hf_name, b_rows in zip(stage.names.hf_names(name), _split(stage.shape, b, rule.fuse), strict=True):
            module = "base_model.model." + hf_name.removesuffix(".weight")
            yield f"{module}.lora_A.weight", a
            yield f"{module}.lora_B.weight", b_rows


def _own_values(stage: StageModel) -> Iterator[tuple[str, Tensor, Tensor]]:
    merged = {f"{name}.weight": layer for name, layer in stage.adapted_layers()}
    for name, param in stage.named_parameters():
        yield name, param, merged[name].merged_weight() if name in merged else param.detach()


def _split(shape: ModelShape, full: Tensor, fuse: str | None) -> tuple[Tensor, ...]:
    match fuse:
        case None | "stacked":
            return (full,)
        case "stacked_gate_up":
            return (layout.fc1_to_interleaved(full),)
        case "stacked_down":
            return (layout.fc2_to_down(full),)
        case "qkv":
            return layout.split_qkv(full, groups=shape.kv_heads, head_dim=shape.head_dim)
        case "gate_up":
            return layout.split_gate_up(full)
    raise ValueError(f"unknown fused layout {fuse!r}")


def pipeline_hf_tensors(stage: StageModel, tensors: Callable[[StageModel], Iterator[tuple[str, Tensor]]] = hf_tensors
                        ) -> Iterator[tuple[str, Tensor]]:
    """`tensors(stage)` (`hf_tensors`, or `hf_adapter_tensors`) of every pipeline stage, delivered in stage order
    to every rank of the pipeline.

    Each stage in turn sends its tensors one at a time over the pipeline group (a name broadcast,
    then the tensor), so no rank ever holds more than one extra full tensor.
    """
    if stage.groups.pp_size == 1:
        yield from tensors(stage)
        return
    pp_ranks = dist.get_process_group_ranks(stage.groups.pp)
    for index, src in enumerate(pp_ranks):
        mine = tensors(stage) if index == stage.groups.pp_rank else None
        while True:
            item = next(mine, None) if mine is not None else None
            header = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
            dist.broadcast_object_list(header, src=src, group=stage.groups.pp)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            tensor = item[1].contiguous() if item is not None else torch.empty(
                shape, dtype=dtype, device=current_device())
            dist.broadcast(tensor, src=src, group=stage.groups.pp)
            yield name, tensor


def _pad_rows(full: Tensor, rows: int) -> Tensor:
    """Zero rows appended to a vocabulary matrix up to Megatron's padded size."""
    if full.shape[0] == rows:
        return full
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
