"""Megatron's tensor-parallel linear layers with a low-rank adapter beside the weight (megarl.engine.lora builds
them into the local layer spec): output = W x + (alpha / rank) B A dropout(x).

The adapter is split the way its layer is, so no rank ever holds more than its share and the communication
runs over the rank-r activations, not the hidden ones:
- column-parallel (W split on its output dim): A [r, in] replicated, B [out / tp, r] split like W;
- row-parallel (W split on its input dim): A [r, in / tp] split like W, B [out, r] replicated.
Under sequence parallelism the replicated factor sees only this rank's tokens, so its gradient is a partial
sum over TP; it is tagged `sequence_parallel`, which is how Megatron's finalize_model_grads knows to sum it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  set_tensor_model_parallel_attributes)
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import Tensor


@dataclass(frozen=True)
class AdapterShape:
    """What every adapter of a model shares (megarl.config.LoraConfig without the targets)."""

    rank: int
    alpha: float
    dropout: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class _Adapted:
    """What both adapted layers share: the switch, the merged weight and the adapter's dropout."""

    adapter: AdapterShape
    adapter_on: bool  # False: the layer computes W x alone (the base model: megarl.engine.lora.adapters_off)
    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter

    @property
    def split_tokens(self) -> bool:
        """Whether this rank's input holds its share of the tokens (sequence parallelism). An expert's input comes
        from Megatron's dispatcher whole, whatever the sequence split around it."""
        return self.sequence_parallel and not self.explicit_expert_comm

    def merged_weight(self) -> Tensor:
        """This rank's shard of W + (alpha / rank) B A, in W's dtype (the product in fp32). B A is this rank's
        shard of the full product for either split, so the shards gather like W's."""
        delta = self.lora_b.detach().float() @ self.lora_a.detach().float()
        return (self.weight.detach().float() + self.adapter.scale * delta).to(self.weight.dtype)

    def _dropout(self, x: Tensor, *, split: bool) -> Tensor:
        """Dropout on the adapter's input; where that input is a TP rank's own slice (`split`), with Megatron's
        model-parallel random stream, as Megatron drops split activations, else with the stream every TP rank
        shares, so replicated inputs are dropped alike."""
        if not (self.training and torch.is_grad_enabled()) or self.adapter.dropout == 0:  # forward-only: none
            return x
        if split:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(x, self.adapter.dropout)
        return F.dropout(x, self.adapter.dropout)


def _adapter_params(layer, *, a_shape: tuple[int, int], b_shape: tuple[int, int]) -> None:
    """Zero A and B of the given local shapes (megarl.engine.lora.init_adapters draws A), in W's dtype and device.
    An expert's adapter is reduced as its weight is: over the expert-data-parallel ranks, not the data-parallel
    ones (Megatron's DDP reads `allreduce`)."""
    kwargs = dict(dtype=layer.weight.dtype, device=layer.weight.device)
    layer.lora_a = torch.nn.Parameter(torch.zeros(a_shape, **kwargs))
    layer.lora_b = torch.nn.Parameter(torch.zeros(b_shape, **kwargs))
    for factor in (layer.lora_a, layer.lora_b):
        factor.allreduce = getattr(layer.weight, "allreduce", True)


def _check_expert_split(layer) -> None:
    """An expert's linear leaves its tensor-parallel communication to Megatron's dispatcher (explicit expert
    communication): its adapter runs unsplit, so its tensor-parallel group must be one rank
    (megarl.engine.lora.check_lora refuses the rest at build)."""
    if layer.explicit_expert_comm and layer.tp_group.size() > 1:
        raise ValueError("model.lora: expert linear layers take adapters at expert tensor parallelism 1 only")


class LoraColumnParallelLinear(_Adapted, ColumnParallelLinear):
    """ColumnParallelLinear (fused QKV, MLP gate/up) plus an adapter: A replicated, B split on its output dim.
    `gate_up`: the output is [gate; up] with each half split over TP, as Megatron's fc1 is (checkpoints
    reshard B the way they reshard W)."""

    def __init__(self, input_size: int, output_size: int, *, adapter: AdapterShape, gate_up: bool = False,
                 **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        _check_expert_split(self)
        self.adapter, self.adapter_on, self.gate_up = adapter, True, gate_up
        _adapter_params(self, a_shape=(adapter.rank, input_size),
                        b_shape=(self.output_size_per_partition, adapter.rank))
        set_tensor_model_parallel_attributes(self.lora_b, True, 0, 1)
        self.lora_a.sequence_parallel = self.split_tokens

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.adapter_on:
            return output, bias
        # [s(/tp), b, in] -> [s, b, r] on every TP rank
        hidden = F.linear(self._dropout(input_, split=self.split_tokens), self.lora_a)
        if self.split_tokens:  # backward: B's partial gradients summed and split back to this rank's tokens
            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        else:  # backward: B's partial gradients summed, so A's gradient is whole on every rank
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        delta = F.linear(hidden, self.lora_b) * self.adapter.scale  # [s, b, out / tp]
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            delta = gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
        return output + delta, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """W's sharding (dim 0) for B; A replicated."""
        state = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                    {"weight": 0, "bias": 0, "lora_b": 0}, sharded_offsets,
                                                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if self.gate_up:  # Megatron's MLP wraps its fc1 weight this way; B's rows are laid out alike
            key = f"{prefix}lora_b"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets,
                                                      (metadata or {}).get("singleton_local_shards", False))
        return state


class LoraRowParallelLinear(_Adapted, RowParallelLinear):
    """RowParallelLinear (attention output, MLP down) plus an adapter: A split on its input dim, B replicated."""

    def __init__(self, input_size: int, output_size: int, *, adapter: AdapterShape, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        _check_expert_split(self)
        if not self.input_is_parallel:
            raise ValueError("model.lora: only row-parallel layers whose input is already split take adapters")
        self.adapter, self.adapter_on = adapter, True
        _adapter_params(self, a_shape=(adapter.rank, self.input_size_per_partition),
                        b_shape=(output_size, adapter.rank))
        set_tensor_model_parallel_attributes(self.lora_a, True, 1, 1)
        self.lora_b.sequence_parallel = self.split_tokens

    def forward(self, input_: Tensor):
        output, bias = super().forward(input_)
        if not self.adapter_on:
            return output, bias
        partial = F.linear(self._dropout(input_, split=True), self.lora_a)  # [s, b, r], a partial sum over TP
        if self.split_tokens:  # summed, and this rank keeps its tokens: [s / tp, b, r]
            hidden = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            hidden = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        return output + F.linear(hidden, self.lora_b) * self.adapter.scale, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """W's sharding (dim 1) for A; B replicated."""
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"weight": 1, "lora_a": 1}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
