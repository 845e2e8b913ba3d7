"""Lean one-token decode steps for the native engine's dense Llama-family models (Llama, Qwen2, Qwen3, Mistral).

A transformers forward of one token per row spends most of its time on the host deciding things that do not
change from one decode step to the next: it builds the attention mask anew, grows its KV cache by
concatenation, and goes through the generic output and hook plumbing of every module. For a small model on
the CPU that is about five sixths of the step. `LeanDecoder` runs the same modules' own weights and norms
with the mask, the rotary tables and a preallocated KV cache handled directly: the same sums, so the same
logits to fp32 rounding (tests/test_native_engine.py holds it to a full forward of every sequence).

The prefill over the prompts runs the same way: one causal pass that writes the prompts' keys and values
into that cache, in place of transformers' forward and a copy out of its cache. Models it does not cover
(mixture of experts, sliding windows that the sequence outgrows, other attention variants) keep
transformers' forward for every step.
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
    """A batch of `batch` rows whose prompts are left padded to `width`, with room for `new_tokens` more
    positions per row in a preallocated KV cache: `prefill` reads the prompts, `step` feeds one token per row.
    `weights` are `model`'s current FusedWeights."""

    def __init__(self, model, weights: FusedWeights, *, batch: int, width: int, new_tokens: int):
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers)
        self.weights = weights
        self.rotary = _rotary(self.layers[0])
        config = model.config
        head_dim = self.layers[0].self_attn.head_dim
        like = self.base.embed_tokens.weight
        self.caches: list[tuple[Tensor, Tensor]] = [
            tuple(like.new_empty(batch, config.num_key_value_heads, width + new_tokens, head_dim) for _ in "kv")
            for _ in self.layers]
        self.width = width

    def prefill(self, ids: Tensor, attention: Tensor, positions: Tensor, source: Tensor | None = None) -> Tensor:
        """The last position's logits [B, V] over the left-padded prompts `ids` [b, width] (`attention` 0 on
        padding, `positions` their position ids), whose keys and values fill the first `width` slots of the
        cache; with `source` [B], cache row i takes prompt row source[i] (a group's samples share a prompt,
        read once)."""
        width = self.width
        hidden = self.base.embed_tokens(ids)  # [b, width, H]
        cos, sin = self.base.rotary_emb(hidden, positions)
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        # a padding position attends to itself, so no row of the softmax is empty (its output is never read)
        mask = (attention[:, None, None, :].bool() & causal) | torch.eye(width, dtype=torch.bool, device=ids.device)
        for index in range(len(self.layers)):
            q, k, v = self._qkv(index, hidden, cos, sin)
            k_cache, v_cache = self.caches[index]
            k_cache[:, :, :width] = k if source is None else k[source]
            v_cache[:, :, :width] = v if source is None else v[source]
            hidden = self._attend_and_mlp(index, hidden, q, k, v, mask)
        logits = self.model.lm_head(_norm(self.base.norm, hidden[:, -1:]))[:, -1]
        return logits if source is None else logits[source]

    def step(self, tokens: Tensor, positions: Tensor, attention: Tensor, t: int) -> Tensor:
        """Logits [B, V] after feeding `tokens` [B] at `positions` [B, 1], the batch's t-th new token
        (t >= 1); `attention` [B, >= width + t] marks the real positions (0 on padding)."""
        slot = self.width + t - 1
        length = slot + 1
        hidden = self.base.embed_tokens(tokens[:, None])  # [B, 1, H]
        cos, sin = self.base.rotary_emb(hidden, positions)  # [B, 1, D]
        mask = attention[:, None, None, :length].bool()
        for index in range(len(self.layers)):
            q, k, v = self._qkv(index, hidden, cos, sin)
            k_cache, v_cache = self.caches[index]
            k_cache[:, :, slot] = k[:, :, 0]
            v_cache[:, :, slot] = v[:, :, 0]
            hidden = self._attend_and_mlp(index, hidden, q, k_cache[:, :, :length], v_cache[:, :, :length], mask)
        return self.model.lm_head(_norm(self.base.norm, hidden))[:, -1]

    def _qkv(self, index: int, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Layer `index`'s rotated queries, keys and values [b, heads, positions, D] of `hidden` [b, positions, H]."""
        layer, (qkv_weight, qkv_bias) = self.layers[index], self.weights.qkv[index]
        attn = layer.self_attn
        heads, groups = attn.config.num_attention_heads, attn.config.num_key_value_heads
        batch, length = hidden.shape[:2]
        qkv = F.linear(_norm(layer.input_layernorm, hidden), qkv_weight, qkv_bias)
        qkv = qkv.view(batch, length, -1, attn.head_dim)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads: heads + groups], qkv[:, :, heads + groups:]
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
            q, k = _norm(attn.q_norm, q), _norm(attn.k_norm, k)
        q, k = self.rotary(q, k, cos, sin, unsqueeze_dim=2)  # q [B, positions, heads, D]: cos to [B, positions, 1, D]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend_and_mlp(self, index: int, hidden: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """The rest of layer `index` after the projections: attention of `q` over `k`, `v` under `mask`, the
        output projection and the MLP, each added to the residual stream `hidden`."""
        layer = self.layers[index]
        attn = layer.self_attn
        batch, length = hidden.shape[:2]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        gate_up = self.weights.gate_up[index]
        gate, up = F.linear(_norm(layer.post_attention_layernorm, hidden), gate_up).chunk(2, dim=-1)
        return hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
