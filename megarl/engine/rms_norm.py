"""RMSNorm for Megatron's local (non Transformer Engine) layer spec that also runs under sequence parallelism.

Megatron's local spec builds its norms with `WrappedTorchNorm`, which refuses `sequence_parallel`. The
function itself does not care: under sequence parallelism each tensor-parallel rank normalizes its own slice
of the sequence with the same weight, row by row. What changes is the weight's gradient: each rank's copy
only sees its slice, so the copies must be summed over the tensor-parallel group. Megatron's
`finalize_model_grads` does that for every parameter tagged `sequence_parallel = True`, which is what
Transformer Engine and apex norms tag; this one does the same.

q/k norms (Qwen3) normalize each attention head after the QKV projection, whose input was already gathered
back to the whole sequence: their rows are not split over the sequence but their heads are split over TP,
and Megatron sums their gradients over TP by name (`q_layernorm`, `k_layernorm`) with or without sequence
parallelism. They are built with `sequence_split=False`.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (same parameter `weight`, same computation), built from Megatron's module arguments,
    with the weight tagged for sequence-parallel gradient reduction when its input is sequence-split."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, sequence_split: bool = True, **unused):
        # `unused`: Megatron's norm arguments the local spec has no use for (persist_layer_norm, ...)
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"megarl's local norm is a plain RMSNorm; config has normalization "
                             f"{config.normalization!r}, zero-centered gamma {config.layernorm_zero_centered_gamma}")
        # in the model's dtype, as Transformer Engine's norms and every other weight of the layer: bf16
        # activations reach torch's fused kernel only beside a bf16 weight, and a push carries no fp32 norms
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel and sequence_split)
