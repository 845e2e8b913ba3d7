"""Lean one-token decode steps for the native engine's dense Llama-family models (Llama, Qwen2, Qwen3, Mistral).

A transformers forward of one token per row spends most of its time on the host deciding things that do not
change from one decode step to the next: it builds the attention mask anew, grows its KV cache by
concatenation, and goes through the generic output and hook plumbing of every module. For a small model on
the CPU that is about five sixths of the step. `LeanDecoder` runs the same modules' own weights and norms
with the mask, the rotary tables and a preallocated KV cache handled directly: the same sums, so the same
logits to fp32 rounding (tests/test_native_engine.py holds it to a full forward of every sequence).

It takes over after the prefill, which stays transformers' own forward: the prompts' keys and values are
copied out of that forward's cache once. Models it does not cover (mixture of experts, sliding windows that
the sequence outgrows, other attention variants) keep transformers' forward for every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

COVERED = {"llama", "qwen2", "qwen3", "mistral"}


def covers(model, length: int) -> bool:
    """Whether `LeanDecoder` computes what `model`'s own forward computes, for sequences up to `length`."""
    config = model.config
    if config.model_type not in COVERED or getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True) and any(
        kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ["sliding_attention"]))
    if window is not None and uses_window and length > window:
        return False
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or getattr(base, "rotary_emb", None) is None:
        return False
    return all(hasattr(layer.mlp, "gate_proj") and hasattr(layer.self_attn, "scaling") for layer in layers)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanDecoder:
    """Decode steps over a batch whose prompts (left padded to `width`) a transformers forward has read into
    `cache`; room for `new_tokens` more positions per row."""

    def __init__(self, model, cache, *, width: int, new_tokens: int):
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers)
        self.caches: list[tuple[Tensor, Tensor]] = []
        for index in range(len(self.layers)):
            keys, values = _layer_states(cache, index)
            batch, heads, prompt, dim = keys.shape
            if prompt != width:
                raise ValueError(f"prefill cache holds {prompt} positions, expected {width}")
            k = keys.new_empty(batch, heads, width + new_tokens, dim)
            v = values.new_empty(batch, heads, width + new_tokens, dim)
            k[:, :, :width], v[:, :, :width] = keys, values
            self.caches.append((k, v))
        self.width = width

    def step(self, tokens: Tensor, positions: Tensor, attention: Tensor, t: int) -> Tensor:
        """Logits [B, V] after feeding `tokens` [B] at `positions` [B, 1], the batch's t-th new token
        (t >= 1); `attention` [B, >= width + t] marks the real positions (0 on padding)."""
        slot = self.width + t - 1
        length = slot + 1
        hidden = self.base.embed_tokens(tokens[:, None])  # [B, 1, H]
        cos, sin = self.base.rotary_emb(hidden, positions)  # [B, 1, D]
        cos, sin = cos[:, None], sin[:, None]
        mask = attention[:, None, None, :length].bool()
        batch = tokens.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, self.caches):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(batch, 1, -1, attn.head_dim)
            k = attn.k_proj(x).view(batch, 1, -1, attn.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = _rotate(q.transpose(1, 2), cos, sin)
            k_cache[:, :, slot] = _rotate(k.transpose(1, 2), cos, sin)[:, :, 0]
            v_cache[:, :, slot] = attn.v_proj(x).view(batch, -1, attn.head_dim)
            out = F.scaled_dot_product_attention(q, k_cache[:, :, :length], v_cache[:, :, :length], attn_mask=mask,
                                                 scale=attn.scaling, enable_gqa=True)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(self.base.norm(hidden))[:, -1]


def _layer_states(cache, index: int) -> tuple[Tensor, Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[index].keys, layers[index].values
    return cache[index][:2]
