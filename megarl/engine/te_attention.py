"""Transformer Engine's core attention for shared-prompt rows (train.share_prompts, megarl.packing.shared_row).

A shared row holds a group's prompt once, then each sample's own tokens, every segment packed ("thd"). Each
own token attends to its prompt and to its own earlier tokens. Transformer Engine's packed attention takes
queries and keys per segment with their own bounds (`cu_seqlens_q`, `cu_seqlens_kv`), and its
`padding_causal_bottom_right` mask aligns each segment's causal mask to the end of its keys. So the keys and
values are gathered segment by segment (`megarl.packing.SharedKeys`): for an own segment, its prompt's tokens,
then its own. Its query i then sees the whole prompt and its own keys up to i. A segment without a prompt (a
prompt itself, a sample alone, padding) has equal query and key counts, where bottom-right is plain causal.

The backends TE 2.11 picks from (`get_attention_backend`) and what each does with the call:
- flash-attn 2 or 3 (fp16/bf16): `flash_attn_varlen_func` with both `cu_seqlens` and causal=True, which
  flash-attn (>= 2.1) aligns bottom-right per segment;
- cuDNN fused attention (fp16/bf16, where cuDNN takes bottom-right "thd"; max_seqlen_q <= max_seqlen_kv,
  equal here): both `cu_seqlens` and the mask type as given;
- the unfused backend (every fp32 run, and fp16/bf16 where neither applies): segments to padded rows, the
  mask from `get_padding_mask`/`get_full_mask`, which bound each segment's keys by `cu_seqlens_kv` only for
  cross-attention. Megatron builds the layer as self-attention, where the keys are bounded by `cu_seqlens_q`:
  the bottom-right offset is then 0 and an own token sees the prompt's first tokens, not the whole prompt. So
  the shared call runs the unfused backend as cross-attention, as TE does itself to attend queries to a longer
  KV cache; flash and fused read the attention type only for padded ("sbhd", "bshd") calls.
tests/test_shared_prompts.py checks the call against TE 2.11's own mask functions. None of the backends takes
the bottom-right mask with context parallelism, which train.share_prompts refuses.

Megatron's `TEDotProductAttention.forward` maps its mask enum, which has no bottom-right padding mask, onto
TE's names, so a shared row calls TE's own forward directly. Everything else (padded rows, plain packed rows)
goes through Megatron's forward unchanged.

Rotary embeddings: a shared row reaches this attention unrotated with its frequencies per token, and is
rotated here in one op (megarl.engine.local_attention.rope_at_position_ids).

The gather costs a copy of each prompt's keys and values per own segment, which the backward adds back into the
prompt's (autograd of the index). The prompt's attention to itself and every linear layer, norm and MLP run on
it once.

Imported only where Transformer Engine is used (megarl.engine.model.build_gpt).
"""

from __future__ import annotations

from megatron.core.extensions.transformer_engine import TEDotProductAttention
from torch import Tensor
from transformer_engine.pytorch import DotProductAttention

from megarl.engine.local_attention import SharedPromptParams, rotate_shared_row, shared_row_inputs


class SharedPromptTEAttention(TEDotProductAttention):
    """Megatron's TE core attention, which also takes shared-prompt rows (`SharedPromptParams`)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, attn_mask_type,
                attention_bias: Tensor | None = None, packed_seq_params=None, num_splits: int | None = None
                ) -> Tensor:
        if not isinstance(packed_seq_params, SharedPromptParams):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params, num_splits=num_splits)
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("a shared-prompt row's attention takes no attention mask or bias of its own")
        if self.config.qk_clip or self.config.log_max_attention_logit:
            raise ValueError("train.share_prompts does not support model.megatron.qk_clip or "
                             "log_max_attention_logit (Megatron's TE attention reads max logits per call)")
        query, key = rotate_shared_row(query, key, packed_seq_params, self.config)
        key, value, kwargs = shared_row_inputs(key, value, packed_seq_params)
        if num_splits is None:
            num_splits = self.num_splits
        if num_splits is not None:
            kwargs["num_splits"] = num_splits
        # the unfused backend bounds each segment's keys by cu_seqlens_kv only as cross-attention (module
        # docstring); set back after the call (the backward reuses the forward's mask), so Megatron's own
        # calls (padded and plain packed rows) stay self-attention
        self.unfused_attention.attention_type = "cross"
        try:
            return DotProductAttention.forward(self, query, key, value, None, **kwargs)
        finally:
            self.unfused_attention.attention_type = self.attention_type
