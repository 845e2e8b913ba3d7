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

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

COVERED = {"llama", "qwen2", "qwen3", "mistral"}


def covers(model, length: int) -> bool:
    """Whether `LeanDecoder` computes what `model`'s own forward computes, for sequences up to `length`."""
    config = model.config
    if not fusable(model) or getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True) and any(
        kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ["sliding_attention"]))
    return window is None or not uses_window or length <= window


def fusable(model) -> bool:
    """A dense model of the covered families, laid out as their transformers classes are (FusedWeights)."""
    base = getattr(model, "model", None)
    if model.config.model_type not in COVERED or getattr(base, "rotary_emb", None) is None:
        return False
    return all(all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "config"))
               and all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
               and _rotary(layer) is not None for layer in base.layers)


def _rotary(layer):
    """The model family's own `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`, from its modeling module."""
    return getattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb", None)


class FusedWeights:
    """Each layer's q, k and v projections as one matrix, and its gate and up projections as another: one matrix
    multiply where transformers runs three and two. The model's own parameters become views of these rows, so
    they hold one copy of the weights and whatever is written to the parameters (a weight push) is here too."""

    def __init__(self, model):
        self.qkv: list[tuple[Tensor, Tensor | None]] = []
        self.gate_up: list[Tensor] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            bias = _stack(projections, "bias") if attn.q_proj.bias is not None else None
            self.qkv.append((_stack(projections, "weight"), bias))
            self.gate_up.append(_stack((mlp.gate_proj, mlp.up_proj), "weight"))


def _stack(modules, name: str) -> Tensor:
    """The modules' `name` parameters stacked along rows into one tensor, of which each becomes a view."""
    whole = torch.cat([getattr(module, name).detach() for module in modules])
    start = 0
    for module in modules:
        param = getattr(module, name)
        rows = param.shape[0]
        setattr(module, name, torch.nn.Parameter(whole[start: start + rows], requires_grad=param.requires_grad))
        start += rows
    return whole


def _norm(module, x: Tensor) -> Tensor:
    """transformers' RMSNorm: torch's fused kernel in fp32, where it computes the same (the module scales in
    fp32 and casts to the input dtype before the weight multiplies, which only differs below fp32)."""
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return F.rms_norm(x, module.weight.shape, module.weight, module.variance_epsilon)
    return module(x)


class LeanDecoder:
    """Decode steps over a batch whose prompts (left padded to `width`) a transformers forward has read into
    `cache`; room for `new_tokens` more positions per row. `weights` are `model`'s current FusedWeights."""

    def __init__(self, model, cache, weights: FusedWeights, *, width: int, new_tokens: int):
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers)
        self.weights = weights
        self.rotary = _rotary(self.layers[0])
        self.caches: list[tuple[Tensor, Tensor]] = []
        for layer_cache in cache.layers:
            keys, values = layer_cache.keys, layer_cache.values
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
        mask = attention[:, None, None, :length].bool()
        batch = tokens.shape[0]
        for layer, (k_cache, v_cache), (qkv_weight, qkv_bias), gate_up in zip(
                self.layers, self.caches, self.weights.qkv, self.weights.gate_up):
            attn = layer.self_attn
            heads, groups = attn.config.num_attention_heads, attn.config.num_key_value_heads
            qkv = F.linear(_norm(layer.input_layernorm, hidden), qkv_weight, qkv_bias).view(batch, 1, -1, attn.head_dim)
            q, k, v = qkv[:, :, :heads], qkv[:, :, heads: heads + groups], qkv[:, :, heads + groups:]
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
                q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
            q, k = self.rotary(q, k, cos, sin, unsqueeze_dim=2)  # q [B, 1, heads, D]: cos to [B, 1, 1, D]
            q = q.transpose(1, 2)
            k_cache[:, :, slot] = k[:, 0]
            v_cache[:, :, slot] = v[:, 0]
            out = F.scaled_dot_product_attention(q, k_cache[:, :, :length], v_cache[:, :, :length], attn_mask=mask,
                                                 scale=attn.scaling, enable_gqa=True)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1))
            gate, up = F.linear(_norm(layer.post_attention_layernorm, hidden), gate_up).chunk(2, dim=-1)
            hidden = hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return self.model.lm_head(_norm(self.base.norm, hidden))[:, -1]

