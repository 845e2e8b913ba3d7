"""Core attention for Megatron's local (non Transformer Engine) layer spec, the one that runs on CPU: packed
sequences and context parallelism, which the local `DotProductAttention` refuses.

Packed sequences: Megatron hands packed ("thd") query, key and value [t, heads, dim] and `PackedSeqParams`
to the core attention; rotary embeddings were already applied per segment from `cu_seqlens` (positions
restart at 0 in every sequence; a shared-prompt row is rotated here instead, by its position ids:
`rope_at_position_ids`). Transformer Engine's attention takes that as is. The local one refuses it,
so this one computes the same thing: each segment's causal attention over its own tokens. With the fused
kernel (below), the segments are gathered into a batch of rows as long as the longest, attended under the
causal mask (a row's padding comes after its segment's tokens, so the mask already hides it) and scattered
back: n x L^2 scores for n segments of at most L tokens. When that is more than t^2 (one long sequence among
many short ones), or without the fused kernel, the row of t tokens is attended under a t x t block-diagonal
causal mask instead: a token attends to the earlier tokens of its own segment only. Megatron's masked softmax
fills masked scores with -10000 before the softmax, as it does with the causal mask of an unpacked batch, so
each sequence's attention weights equal those of the same sequence alone (exp(-10000 - max) is 0 in fp32 and
bf16).

Context parallelism: each rank holds two chunks of every sequence (megarl.engine.context_parallel) with
rotary embeddings already applied at their true positions. Keys and values are all-gathered over the
context-parallel group, and the causal mask compares true positions: this rank's queries against every
rank's keys. Transformer Engine exchanges them in a ring instead; the result is the same attention.

The attention itself is torch's fused `scaled_dot_product_attention` (causal, or under the mask above;
grouped keys and values without copies) whenever it computes what Megatron's local attention computes:
softmax(scale * q k^T) v with the vanilla softmax and no attention dropout, the recipes' settings. Megatron's
version takes three matmuls, a GQA copy of keys and values and a mask built per call; softmax-offset
variants and attention dropout still go through it.

Attention sinks and sliding windows (gpt-oss: softmax_type "learnable"; gpt-oss and Gemma 3: window_size on the
layers window_attn_skip_freq marks) are computed here too (`sink_window_attention`), padded, packed and context-
parallel: Megatron's masked softmax builds its window mask on the GPU and in place of the mask it is given,
which would let packed segments see each other. The window counts positions, which in a padded row, a packed
segment's row and a block-masked row are the tokens' distances in the row; a context-parallel rank's chunks
and a shared-prompt row are not laid out that way, so a windowed layer refuses them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from megarl.engine.context_parallel import all_gather_keys_values, cp_positions
from megarl.packing import SharedKeys


def block_causal_mask(cu_seqlens: Tensor, total: int, *, device, prefix_of: Tensor | None = None) -> Tensor:
    """[1, 1, t, t] bool, True where attention is masked: across segments, or to a later position. With
    `prefix_of` [segments] (a shared-prompt row, megarl.packing.shared_row), a segment's tokens also see every
    token of segment prefix_of[s] (its group's prompt, earlier in the row; -1: none)."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    segment = torch.bucketize(torch.arange(total, device=device), bounds[1:], right=True)  # [t]
    pos = torch.arange(total, device=device)
    allowed = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
    if prefix_of is not None:
        allowed |= prefix_of.to(device)[segment][:, None] == segment[None, :]
    return ~allowed[None, None]


@dataclass
class SharedPromptParams(PackedSeqParams):
    """A shared-prompt packed row as attention takes it: the segments of `PackedSeqParams`, and for each the
    segment its tokens also see whole (`SharedPrompts.prefix_of`)."""

    prefix_of: Tensor | None = None  # [segments] long
    keys: SharedKeys | None = None   # the row's keys segment by segment, for Transformer Engine's attention
    positions: Tensor | None = None  # [t] long: each token's position id, set by `rope_at_position_ids`
    freqs: Tensor | None = None      # [t, 1, 1, rotary dim]: rotary frequencies at `positions`, likewise


def shared_row_inputs(key: Tensor, value: Tensor, params: SharedPromptParams) -> tuple[Tensor, Tensor, dict]:
    """Keys and values [t, groups, dim] of a shared row gathered segment by segment, and the arguments of TE's
    packed attention for the row's queries (in row order) against them."""
    keys = params.keys
    index = keys.index.to(key.device)
    return key[index], value[index], dict(
        qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
        cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=keys.cu_seqlens.to(key.device),
        max_seqlen_q=params.max_seqlen_q, max_seqlen_kv=keys.max_seqlen)


def rope_at_position_ids(model) -> None:
    """Make GPTModel `model` rotate the queries and keys of a shared-prompt row by the position ids it is
    given (own tokens continue after their prompt), not by each segment's offset from its start.

    Megatron rotates a packed row segment by segment (`rope_utils._apply_rotary_pos_emb_thd`), reading every
    segment's start from the device: a host sync per segment, for queries and keys, in every layer. So a
    shared row bypasses it: the model's hook keeps the position ids in the row's `SharedPromptParams`, the
    decoder's hook puts the frequency table's rows at those ids there instead of handing the table to
    Megatron's attention, and the core attention rotates the row in one elementwise op (`rotate_shared_row`).
    The table covers max_seqlen_q positions, which a shared row sets to its longest sequence."""

    def keep_positions(_module, args, kwargs):
        params = kwargs.get("packed_seq_params")
        if not isinstance(params, SharedPromptParams):
            return None
        positions = args[1] if len(args) > 1 else kwargs["position_ids"]  # [1, t]
        return args, kwargs | {"packed_seq_params": replace(params, positions=positions[0])}

    def frequencies_per_token(_module, args, kwargs):
        params, table = kwargs.get("packed_seq_params"), kwargs.get("rotary_pos_emb")  # table [max, 1, 1, dim]
        if not isinstance(params, SharedPromptParams) or table is None:
            return None
        freqs = table[params.positions.to(table.device)]  # [t, 1, 1, dim]
        return args, kwargs | {"packed_seq_params": replace(params, freqs=freqs), "rotary_pos_emb": None}

    model.register_forward_pre_hook(keep_positions, with_kwargs=True)
    model.decoder.register_forward_pre_hook(frequencies_per_token, with_kwargs=True)


def rotate_shared_row(query: Tensor, key: Tensor, params: SharedPromptParams, config) -> tuple[Tensor, Tensor]:
    """query [t, heads, dim] and key [t, groups, dim] of a shared row rotated by the frequencies of their
    position ids (`params.freqs`, from `rope_at_position_ids`; as they are without it: no rotary embedding).

    The op Megatron's packed RoPE ends in, on the frequencies it would gather segment by segment: the same
    numbers, in one op over the row. Unfused, as train.share_prompts has it (model.megatron.apply_rope_fusion
    off); GPTModel's "rope" embedding scales by 1, its "yarn" one by the YaRN factor the config gives."""
    if params.freqs is None:
        return query, key
    rotate = lambda t: _apply_rotary_pos_emb_bshd(  # noqa: E731  [t, h, dim] as [t, 1, h, dim]
        t.unsqueeze(1), params.freqs, rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention,
        mscale=_yarn_get_concentration_factor_from_config(config)).squeeze(1)
    return rotate(query), rotate(key)


def segment_bounds(packed_seq_params) -> Tensor:
    """[n + 1] the offsets where the packed row's segments (sequences, and padding) begin, and its end."""
    return packed_seq_params.cu_seqlens_q.to(torch.long)


def segment_rows(bounds: Tensor, total: int) -> tuple[Tensor, Tensor] | None:
    """For attention segment by segment: index [n, L] of the row's tokens laid out one segment per row (L =
    the longest segment; a row past its segment's end points at later tokens of the packed row, which the
    causal mask hides from the segment's own) and valid [n, L] (the real ones, in token order). None when n
    x L^2 scores are not fewer than the t x t of one masked row."""
    lengths = bounds[1:] - bounds[:-1]
    longest = int(lengths.max())
    if int(bounds[-1]) != total or len(lengths) * longest * longest >= total * total:
        return None
    offsets = torch.arange(longest, device=bounds.device)
    index = (bounds[:-1, None] + offsets[None, :]).clamp(max=total - 1)
    return index, offsets[None, :] < lengths[:, None]


def shared_rows(bounds: Tensor, prefix_of: Tensor, total: int) -> tuple | None:
    """A shared-prompt row's attention in two batches of rows (`PackedLocalAttention.shared_prompt_attention`),
    or None when they compute no fewer scores than one t x t masked row (or no segment has a prefix):

    - the segments that see no prefix (prompts, sequences alone, padding), one per row as in `segment_rows`:
      index [a, L] of their tokens, valid [a, L];
    - the segments with a prefix (own tokens after a shared prompt): index [b, R] of their tokens (the
      queries), keys [b, Q + R] (their prompt's tokens, then their own), masked [b, 1, R, Q + R] (a prompt
      column past the prompt's end, an own column after the query) and valid [b, R]."""
    lengths = bounds[1:] - bounds[:-1]
    has = prefix_of >= 0
    if not bool(has.any()):
        return None

    def rows(starts: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
        cols = torch.arange(int(n.max()) if len(n) else 0, device=bounds.device)
        return (starts[:, None] + cols).clamp(max=total - 1), cols[None, :] < n[:, None]

    plain = rows(bounds[:-1][~has], lengths[~has])
    q_index, q_valid = rows(bounds[:-1][has], lengths[has])
    p_index, p_valid = rows(bounds[:-1][prefix_of[has]], lengths[prefix_of[has]])
    own = q_index.shape[1]
    causal = torch.arange(own, device=bounds.device)
    masked = torch.cat([(~p_valid)[:, None, :].expand(-1, own, -1),
                        (causal[None, :] > causal[:, None]).expand(len(q_index), -1, -1)], dim=2)
    scores = plain[0].numel() * plain[0].shape[1] + q_index.numel() * (p_index.shape[1] + own)
    if scores >= total * total:
        return None
    return plain, (q_index, torch.cat([p_index, q_index], dim=1), masked[:, None], q_valid)


class PackedLocalAttention(DotProductAttention):
    """`DotProductAttention` that also takes packed sequences (PackedSeqParams with qkv_format "thd") and
    context parallelism (config.context_parallel_size > 1, over the `cp` group of `pg_collection`)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        # Multi-latent attention passes its query/key and value head widths (k_channels, v_channels), which
        # Megatron's local attention does not take: it reads each width off the tensors it is given, and the
        # output's off config.kv_channels, which megarl sets to the value head width for MLA models.
        cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core.process_groups_config import ProcessGroupCollection

            if pg_collection is None:
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
            cp_group = pg_collection.cp
            # The parent refuses context parallelism because it has no key/value exchange; this class adds
            # it, so the parent is built for what it still computes: attention of this rank's queries.
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.cp_group = cp_group
        # The parent scales the scores by softmax_scale and, with query-key layer scaling, the softmax's
        # input by the layer number it divided out of softmax_scale: one scale in all.
        layer_scaling = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        self.fused_scale = self.softmax_scale * layer_scaling
        self.fused = self.config.softmax_type == "vanilla" and self.attention_dropout.p == 0.0
        self.window = None  # tokens a query sees, itself included; None: every earlier one
        if is_layer_window_attention(self.config.window_size, self.config.window_attn_skip_freq, self.layer_number):
            before, after = self.config.window_size
            if before < 0 or after != 0:
                raise ValueError(f"window_size {self.config.window_size}: the local attention takes a causal window "
                                 "(n earlier tokens, 0 later) only")
            self.window = before + 1
        # sinks and windows are this class's own attention (`sink_window_attention`)
        self.own_softmax = self.config.softmax_type == "learnable" or self.window is not None
        self.by_segment = self.fused or self.own_softmax  # packed rows attended segment by segment

    def sink_window_attention(self, query: Tensor, key: Tensor, value: Tensor, masked: Tensor | None) -> Tensor:
        """Attention of query [sq, b, heads, dim] over key and value [sk, b, groups, dim] -> [sq, b, heads * dim]
        as transformers computes gpt-oss's and Gemma 3's: query i, at key position i + sk - sq, sees the keys `masked` (bool,
        broadcastable to [b, heads, sq, sk]; None: the causal mask) leaves it, within `window` positions of it
        itself included, and its softmax has one more logit in the denominator, its head's sink
        (`softmax_offset`), which weighs no value. The softmax runs in fp32."""
        sq, b, heads, _ = query.shape
        sk = key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, dim]
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.fused_scale  # [b, heads, sq, sk]
        distance = (torch.arange(sq, device=q.device) + sk - sq)[:, None] - torch.arange(sk, device=q.device)[None]
        hidden = distance < 0 if masked is None else masked
        if self.window is not None:
            hidden = hidden | (distance >= self.window)
        scores = scores.float().masked_fill(hidden, float("-inf"))
        if self.softmax_offset is not None:
            sinks = self.softmax_offset.float().reshape(1, -1, 1, 1).expand(b, -1, sq, 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.to(v.dtype), v)  # [b, heads, sq, dim]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def attend(self, query: Tensor, key: Tensor, value: Tensor, masked: Tensor | None, *, attn_mask_type=None,
               attention_bias=None) -> Tensor:
        """Attention of query [sq, b, heads, dim] over key and value [sk, b, groups, dim] -> [sq, b, heads * dim],
        under `masked` (bool, broadcastable to [b, heads, sq, sk], True where masked) or, when it is None, the
        causal mask of the layer."""
        if self.own_softmax:
            if attention_bias is not None:
                raise ValueError("attention with sinks or a sliding window takes no attention bias")
            return self.sink_window_attention(query, key, value, masked)
        if not self.fused or attention_bias is not None or (masked is None and self.attn_mask_type != AttnMaskType.causal):
            return super().forward(query, key, value, masked, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if masked is None else ~masked,
                                             is_causal=masked is None, scale=self.fused_scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def shared_prompt_attention(self, query: Tensor, key: Tensor, value: Tensor, plain: tuple, prefixed: tuple
                                ) -> Tensor:
        """Attention of a shared-prompt row (query, key, value [t, heads or groups, dim]) from `shared_rows`:
        the segments without a prefix each causal over itself, the others over their prompt and their own
        earlier tokens; the two batches' outputs back in row order, [t, 1, heads * dim]."""
        index, valid = plain
        gather = lambda t, i: t[i].transpose(0, 1)  # noqa: E731  [t, h, d] -> [columns, rows, h, d]
        out_plain = self.attend(gather(query, index), gather(key, index), gather(value, index), None)
        q_index, k_index, masked, q_valid = prefixed
        out_prefixed = self.attend(gather(query, q_index), gather(key, k_index), gather(value, k_index), masked)
        positions = torch.cat([index[valid], q_index[q_valid]])
        out = torch.cat([out_plain.transpose(0, 1)[valid], out_prefixed.transpose(0, 1)[q_valid]])
        return out[torch.argsort(positions)].unsqueeze(1)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if self.window is not None and (self.cp_group is not None or isinstance(packed_seq_params, SharedPromptParams)):
            raise ValueError(f"layer {self.layer_number} attends within a sliding window of {self.window} tokens, "
                             "which context parallelism and shared-prompt rows (train.share_prompts) do not support")
        if self.cp_group is not None:
            if packed_seq_params is not None or attention_mask is not None:
                raise ValueError("context-parallel local attention takes padded rows under the causal mask only "
                                 "(no packed sequences, no attention mask of its own)")
            # query [s, b, heads, dim]; keys and values [cp * s, b, groups, dim] after the exchange
            key, value, key_pos = all_gather_keys_values(key, value, group=self.cp_group)
            cp = self.cp_group.size()
            query_pos = cp_positions(query.shape[0] * cp, cp=cp, rank=self.cp_group.rank(), device=query.device)
            mask = (key_pos[None, :] > query_pos[:, None])[None, None]  # [1, 1, s, cp * s]
            return self.attend(query, key, value, mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        if packed_seq_params is None:
            return self.attend(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
            raise ValueError("packed attention takes qkv_format 'thd' and no attention mask of its own")
        total = query.shape[0]
        bounds = segment_bounds(packed_seq_params).to(query.device)
        prefix_of = getattr(packed_seq_params, "prefix_of", None)
        if prefix_of is not None:  # a shared-prompt row
            query, key = rotate_shared_row(query, key, packed_seq_params, self.config)
            prefix_of = prefix_of.to(query.device)
            split = shared_rows(bounds, prefix_of, total) if self.by_segment and attention_bias is None else None
            if split is not None:
                return self.shared_prompt_attention(query, key, value, *split)
            mask = block_causal_mask(bounds, total, device=query.device, prefix_of=prefix_of)
            return self.attend(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                               attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        rows = segment_rows(bounds, total) if self.by_segment and attention_bias is None else None
        if rows is not None:
            index, valid = rows
            # [t, heads, dim] -> [n, L, heads, dim] -> attention as [L, n, ...] -> the valid [t, 1, heads * dim]
            out = self.attend(*(t[index].transpose(0, 1) for t in (query, key, value)), None)
            return out.transpose(0, 1)[valid].unsqueeze(1)
        mask = block_causal_mask(bounds, total, device=query.device)
        # [t, heads, dim] -> [t, 1, heads, dim]: one row of t tokens; the result is [t, 1, heads * dim]
        return self.attend(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                           attn_mask_type=attn_mask_type, attention_bias=attention_bias)
