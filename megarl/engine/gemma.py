"""Gemma 3 (HF `gemma3_text`, transformers' Gemma3ForCausalLM) on Megatron-core's GPT model.

What Gemma 3 computes beyond a Llama-like layer, and where megarl builds it from Megatron's own modules:

- every RMSNorm scales by (1 + w), computed in fp32 and cast back, with w stored as HF stores it
  (`ZeroCenteredRMSNorm` on the local spec; Transformer Engine's norms with `layernorm_zero_centered_gamma`);
- four norms per layer: the attention and MLP outputs are normed before their residual add (`PostNormLayer`:
  Megatron's TransformerLayer with two more norms, applied in its bias-dropout-add step);
- q/k norms, GeGLU with the tanh approximation (`gelu_tanh`), the attention scale query_pre_attn_scalar ** -0.5
  (TransformerConfig.softmax_scale);
- local layers attend to the last `sliding_window` tokens (TransformerConfig.window_size with
  window_attn_skip_freq, which Megatron's and Transformer Engine's attention read per layer, and
  megarl.engine.local_attention.PackedLocalAttention on the local spec) and rotate by their own RoPE base;
  global layers attend causally with rope_theta and optional linear RoPE scaling (GPTModel's own rotary
  embedding). GPTModel hands one RoPE table to every layer: the local layers swap in a table made from the same
  arguments with the local base (`LocalRope`);
- embeddings scaled by sqrt(hidden) in the embedding dtype, and final logits softcapped, by hooks on the
  embedding and output layer (`adapt_model`).

Tensor and pipeline parallelism are Megatron's: the extra norms act on whole hidden states (sequence-split
under sequence parallelism, their weights tagged for the TP gradient sum like every other layer norm), and
each layer picks its window and RoPE from its global layer number.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from megarl.models.arch import ModelShape


def gelu_tanh(x: Tensor) -> Tensor:
    """GeLU with the tanh approximation: transformers' `gelu_pytorch_tanh`."""
    return F.gelu(x, approximate="tanh")


def transformer_fields(shape: ModelShape) -> dict:
    """TransformerConfig fields of a Gemma 3 model (its sliding windows are megarl.engine.model.layer_variants').
    Megatron's fused bias-activation kernels have no tanh-approximated GeGLU (its fused `gelu` GLU is not F.gelu's
    erf form either), so the activation runs unfused."""
    return dict(activation_func=gelu_tanh, bias_activation_fusion=False, layernorm_zero_centered_gamma=True,
                softmax_scale=shape.attention_scale)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm, transformers' Gemma3RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), in fp32, cast back to
    x's dtype. Built from Megatron's norm arguments; the weight is tagged for the sequence-parallel gradient sum
    when its input is sequence-split (megarl.engine.rms_norm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, *, sequence_split: bool = True, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel and sequence_split)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


@dataclasses.dataclass
class PostNormLayerSubmodules(TransformerLayerSubmodules):
    post_self_attn_layernorm: ModuleSpec | type = IdentityOp  # on the attention output, before its residual add
    post_mlp_layernorm: ModuleSpec | type = IdentityOp        # on the MLP output, before its residual add


class LocalRope:
    """The local layers' RoPE table of the current forward: `rope` (a RotaryEmbedding with the local base) called
    with the arguments GPTModel gave its own rotary embedding, kept by a forward hook on that one."""

    def __init__(self, rope):
        self.rope = rope
        self.table: Tensor | None = None

    def keep(self, _module, args, kwargs, _output) -> None:
        self.table = self.rope(*args, **kwargs)


class PostNormLayer(TransformerLayer):
    """Megatron's TransformerLayer with Gemma's norms on the attention and MLP outputs: residual + norm(out),
    applied inside the layer's bias-dropout-add step; a local layer (window attention) rotates by `local_rope`'s
    table instead of the one GPTModel hands to every layer."""

    def __init__(self, config, submodules: PostNormLayerSubmodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection, vp_stage=vp_stage)
        norm = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm)
        self.self_attn_bda = _norm_before_add(self.post_self_attn_layernorm, self.self_attn_bda)
        self.mlp_bda = _norm_before_add(self.post_mlp_layernorm, self.mlp_bda)
        self.is_local = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        self.local_rope: LocalRope | None = None  # set by `adapt_model`

    def forward(self, *args, **kwargs):
        if self.local_rope is not None and kwargs.get("rotary_pos_emb") is not None:
            kwargs["rotary_pos_emb"] = self.local_rope.table
        return super().forward(*args, **kwargs)


def _norm_before_add(norm, bda):
    """A bias-dropout-add builder like `bda` (Megatron's get_bias_dropout_add) that norms the sublayer's output
    (its bias added first) before the dropout and residual add."""
    def build(training: bool, fused: bool):
        add = bda(training, fused)

        def apply(out_with_bias, residual, prob):
            out, bias = out_with_bias
            return add((norm(out if bias is None else out + bias), None), residual, prob)
        return apply
    return build


def post_norm_layer(base: ModuleSpec, norm) -> ModuleSpec:
    """Layer spec `base` (a TransformerLayer's, local or Transformer Engine's, built by megarl.engine.model) as a
    PostNormLayer with `norm` on the attention and MLP outputs: TE's norms, zero-centred through the config, or
    `ZeroCenteredRMSNorm`."""
    parts = {f.name: getattr(base.submodules, f.name) for f in dataclasses.fields(base.submodules)}
    return ModuleSpec(module=PostNormLayer, submodules=PostNormLayerSubmodules(
        **parts, post_self_attn_layernorm=norm, post_mlp_layernorm=norm))


def adapt_model(model, shape: ModelShape) -> None:
    """Gemma 3's model-level pieces on GPTModel `model` (one pipeline chunk): embeddings times sqrt(hidden) in the
    embedding dtype (transformers' Gemma3TextScaledWordEmbedding), the local layers' RoPE table, and final logits
    softcapped to cap * tanh(logits / cap) (elementwise, so on each TP rank's vocabulary slice as on the whole)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if model.pre_process and shape.scaled_embeddings:
        scale = torch.tensor(math.sqrt(shape.hidden), dtype=model.embedding.word_embeddings.weight.dtype)
        model.embedding.register_forward_hook(lambda _module, _args, out: out * scale.to(out.device))
    local_layers = [layer for layer in model.decoder.layers if layer.is_local]
    if local_layers:
        rope = model.rotary_pos_emb
        local = LocalRope(RotaryEmbedding(kv_channels=model.config.kv_channels, rotary_percent=1.0,
                                          rotary_interleaved=model.config.rotary_interleaved,
                                          rotary_base=shape.local_rope_theta, cp_group=rope.cp_group,
                                          use_cpu_initialization=model.config.use_cpu_initialization))
        rope.register_forward_hook(local.keep, with_kwargs=True)
        for layer in local_layers:
            layer.local_rope = local
    if model.post_process and shape.final_logit_softcap:
        cap = shape.final_logit_softcap
        model.output_layer.register_forward_hook(
            lambda _module, _args, out: (torch.tanh(out[0] / cap) * cap, *out[1:]))
