"""Packed sequences for Megatron's local (non Transformer Engine) attention, the one that runs on CPU.

Megatron hands packed ("thd") query, key and value [t, heads, dim] and `PackedSeqParams` to the core
attention; rotary embeddings were already applied per segment from `cu_seqlens` (positions restart at 0 in
every sequence). Transformer Engine's attention takes that as is. The local `DotProductAttention` refuses
it, so this one computes the same thing as a batch of one row of t tokens under a block-diagonal causal
mask: a token attends to the earlier tokens of its own segment only. Megatron's masked softmax fills masked
scores with -10000 before the softmax, as it does with the causal mask of an unpacked batch, so each
sequence's attention weights equal those of the same sequence alone (exp(-10000 - max) is 0 in fp32 and
bf16). The mask is t x t booleans: fine for the CPU and debugging runs this spec serves.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


def block_causal_mask(cu_seqlens: Tensor, total: int, *, device) -> Tensor:
    """[1, 1, t, t] bool, True where attention is masked: across segments, or to a later position."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    segment = torch.bucketize(torch.arange(total, device=device), bounds[1:], right=True)  # [t]
    pos = torch.arange(total, device=device)
    allowed = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
    return ~allowed[None, None]


class PackedLocalAttention(DotProductAttention):
    """`DotProductAttention` that also takes packed sequences (PackedSeqParams with qkv_format "thd")."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
            raise ValueError("packed attention takes qkv_format 'thd' and no attention mask of its own")
        total = query.shape[0]
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q, total, device=query.device)
        # [t, heads, dim] -> [t, 1, heads, dim]: one row of t tokens; the result is [t, 1, heads * dim]
        return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                               attn_mask_type=attn_mask_type, attention_bias=attention_bias)
