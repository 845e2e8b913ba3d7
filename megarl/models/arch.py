"""What megarl needs to know about a HuggingFace checkpoint, read from its config.json alone.

`ModelShape` is the architecture-independent description (sizes, norms, RoPE, biases, tying, experts) that
both the Megatron model builder and the weight name tables work from. Reading it needs no torch or
transformers, so recipe checks and planning stay cheap.

Mixture-of-experts routing, as transformers computes it: router logits -> softmax over all experts -> top-k;
with `norm_topk` (Mixtral always, Qwen MoE when `norm_topk_prob`) the k probabilities are renormalized to sum
to 1, which equals a softmax over the k selected logits. Qwen2-MoE adds a shared expert whose output is
scaled by sigmoid(shared_expert_gate(x)).

gpt-oss: a router with a bias that softmaxes its top-k logits (`norm_topk`), experts with biases and a clamped
SwiGLU, biases on every attention projection, a learnable per-head sink logit in each attention softmax's
denominator, sliding-window attention in the layers `layer_types` names, and YaRN rotary embeddings.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

DENSE_ARCHS = ("qwen2", "llama", "mistral", "qwen3", "gemma3_text")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss")
SUPPORTED_ARCHS = DENSE_ARCHS + MOE_ARCHS
# Routed by sigmoid scores with a load-balancing bias on the choice, in groups, after dense first layers.
SIGMOID_MOE_ARCHS = ("glm4_moe", "deepseek_v3")
# Vision-language models: a vision tower whose merged patch features replace the prompt's image tokens, under a
# Qwen2 (Qwen2.5-VL) or Qwen3 (Qwen3-VL) text model with multimodal RoPE. Read, not yet trained (ModelShape.vision).
VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class YarnRope:
    """YaRN rotary frequencies (rope type "yarn", https://arxiv.org/abs/2309.00071) as transformers computes them:
    frequencies interpolated by `factor` below the `beta_slow`..`beta_fast` rotation band and kept above it, and
    cos and sin scaled by 0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio when both are given)."""

    factor: float
    original_max_position: int      # `original_max_position_embeddings`
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True           # the correction band's bounds rounded to whole dimensions
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class VisionShape:
    """The vision side of a Qwen2.5-VL or Qwen3-VL checkpoint (config.json's `vision_config` and token ids).

    An image of H x W pixels is cut into `patch` x `patch` patches (`temporal_patch` frames deep: a still image is
    repeated), embedded by a Conv3d, run through `depth` ViT blocks, and each `spatial_merge` x `spatial_merge`
    group of neighbouring patches is merged by an MLP into one `out_hidden`-wide feature that replaces one
    `image_token_id` in the prompt, in order. Text positions are multimodal RoPE: each head's rotary frequencies
    are split into `mrope_section` (time, height, width) parts, each rotated by its own position index."""

    depth: int                 # ViT blocks
    hidden: int                # ViT width
    heads: int                 # ViT attention heads
    ffn: int                   # ViT MLP width
    patch: int                 # patch side in pixels
    temporal_patch: int        # frames per patch (images are repeated to fill them)
    spatial_merge: int         # merged patches per side: one image token per spatial_merge ** 2 patches
    out_hidden: int            # width of a merged feature: the text model's hidden size
    image_token_id: int        # <|image_pad|>: one per merged patch
    video_token_id: int        # <|video_pad|>
    vision_start_id: int       # <|vision_start|>, before an image's tokens
    vision_end_id: int         # <|vision_end|>, after them
    mrope_section: tuple[int, int, int]  # rotary frequencies per head given to (time, height, width) positions
    mrope_interleaved: bool    # Qwen3-VL: height and width frequencies interleaved with time's; else contiguous
    act: str                   # ViT MLP activation (Qwen2.5-VL: silu, gated; Qwen3-VL: gelu_pytorch_tanh, not)
    window: int = 0            # Qwen2.5-VL: attention windows of this many pixels a side outside `full_blocks`
    full_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: blocks that attend over the whole image
    position_embeddings: int = 0  # Qwen3-VL: learned positions on a square grid of this many, interpolated
    deepstack_blocks: tuple[int, ...] = ()  # Qwen3-VL: the i-th listed block's merged output is added to the
    # image tokens' hidden states after text layer i (DeepStack)


@dataclass(frozen=True)
class ModelShape:
    arch: str                 # HF model_type
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int             # query groups (GQA)
    head_dim: int
    ffn: int
    norm_eps: float
    rope_theta: float
    max_position: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool             # Qwen3: RMSNorm on q and k per head
    llama3_rope_factor: float | None = None  # Llama 3.x frequency scaling
    sliding_window: int | None = None  # attention window in tokens (Mistral); None = full causal
    experts: int = 0          # routed experts per layer; 0 = dense MLP
    topk: int = 0             # experts per token
    moe_ffn: int = 0          # width of each routed expert
    shared_ffn: int = 0       # width of the sigmoid-gated shared expert (Qwen2-MoE); 0 = none
    norm_topk: bool = False   # top-k router probabilities renormalized to sum to 1
    aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (`router_aux_loss_coef`)
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)
    moe_score: str = "softmax"  # router score function: "softmax", or "sigmoid" (GLM-4.5, DeepSeek-V3)
    expert_bias: bool = False  # sigmoid routing: `e_score_correction_bias` added to the scores that pick experts
    moe_groups: int = 0       # experts in this many groups, `moe_group_topk` groups chosen per token; 0 = none
    moe_group_topk: int = 0
    routed_scale: float = 1.0  # routed experts' weights scaled by this (`routed_scaling_factor`)
    dense_layers: int = 0     # the first layers have a dense MLP of width `ffn` (`first_k_dense_replace`)
    rotary_fraction: float = 1.0  # RoPE on the first fraction of each head's dims (`partial_rotary_factor`)
    # Multi-latent attention (DeepSeek-V3): queries through a rank-`q_lora_rank` bottleneck (0: one projection),
    # keys and values through a shared `kv_lora_rank` latent; each head's query/key is `qk_nope_dim` dims without
    # RoPE then `qk_rope_dim` with it (the key's RoPE part shared by all heads, its dims rotated in interleaved
    # pairs, as DeepSeek's `rope_interleave`), its value `v_head_dim` wide.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    linear_bias: bool = False  # biases on the attention output, the router and the experts (gpt-oss)
    attention_sinks: bool = False  # a learnable per-head logit in the softmax denominator (gpt-oss `sinks`)
    local_window: int | None = None  # tokens a query of a `window_layers` layer sees, itself included
    window_layers: tuple[bool, ...] = ()  # per layer: attends within `local_window` (gpt-oss `layer_types`)
    swiglu_limit: float | None = None  # clamped SwiGLU (gpt-oss): gate <= limit, |up| <= limit, (up + 1) * act
    yarn: YarnRope | None = None  # YaRN rotary embeddings (gpt-oss, DeepSeek-V3)
    # Gemma 3 (megarl.engine.gemma); the defaults are every other architecture's
    zero_centered_norms: bool = False  # every RMSNorm scales by (1 + weight), the weight stored as HF stores it
    post_norms: bool = False  # attention and MLP outputs are normed before their residual add; GeGLU (tanh)
    scaled_embeddings: bool = False  # embeddings multiplied by sqrt(hidden), in the embedding dtype
    attention_scale: float | None = None  # softmax scale of q k^T; None = head_dim ** -0.5
    local_rope_theta: float | None = None  # RoPE base of the local layers (rope_theta: the global ones')
    rope_linear_factor: float | None = None  # global layers' linear RoPE scaling: positions divided by it
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    vision: VisionShape | None = None  # a vision-language model's vision tower; None for a text model

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V3) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        """Layers that route to experts: the last `layers - dense_layers` (0 for a dense model)."""
        return self.layers - self.dense_layers if self.is_moe else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` routes to experts (the first `dense_layers` have a dense MLP)."""
        return self.is_moe and layer >= self.dense_layers


def read_shape(model_dir: str | Path) -> ModelShape:
    """Parse `model_dir/config.json`; an unsupported architecture is a ValueError naming the file.

    Every part of a run asks for the shape (the launch's layout check, the rollout engine, each trainer
    model), so a file is parsed once per process and read again only when it has changed."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not an HF checkpoint directory: it has no config.json")
    stat = path.stat()
    return _parse_shape(path, path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _parse_shape(path: Path, resolved: Path, mtime_ns: int, size: int) -> ModelShape:
    """The shape in config.json `path` (named in errors) as it was when the file at `resolved` had
    modification time `mtime_ns` and `size` bytes: the arguments are the cache's key."""
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    arch = cfg.get("model_type")
    quant = cfg.get("quantization_config") or {}
    if quant:
        # megarl trains, pushes and exports bf16/fp32 tensors; a quantized checkpoint's weights are other tensors
        raise ValueError(f"{path}: quantization_config.quant_method {quant.get('quant_method')!r}: quantized "
                         "weights are not supported; dequantize the checkpoint to bf16 first (gpt-oss's MXFP4: "
                         "transformers' Mxfp4Config(dequantize=True), then save_pretrained; DeepSeek-V3's fp8 blocks: "
                         "its weights times their scale_inv, saved in bf16) and drop quantization_config")
    if arch == "gemma3":
        raise ValueError(f"{path}: model_type 'gemma3' is Gemma 3 with its vision tower "
                         "(Gemma3ForConditionalGeneration), which is not supported; the text model alone (model_type "
                         "'gemma3_text', Gemma3ForCausalLM) is")
    if arch in VLM_ARCHS:
        return _vlm_shape(cfg, path)
    if "vision_config" in cfg:
        names = ", ".join(cfg.get("architectures") or []) or "no architectures given"
        raise ValueError(f"{path}: model_type {arch!r} ({names}) has a vision tower (vision_config): of the "
                         f"vision-language architectures only {', '.join(VLM_ARCHS)} are read")
    if arch == "gemma3_text":
        return _gemma3_shape(cfg, path)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    llama3_factor = rope.get("factor") if rope_type == "llama3" else None
    if arch == "gpt_oss":
        return _gpt_oss_shape(cfg, path, rope)
    if rope_type not in ("default", "llama3", None) and not (rope_type == "yarn" and arch == "deepseek_v3"):
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported (default, llama3; yarn for deepseek_v3)")
    # Mistral and Mixtral apply `sliding_window` whenever it is set; Qwen models only with use_sliding_window.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in ("mistral", "mixtral")) else None
    fields = dict(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden=cfg["hidden_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position=cfg.get("max_position_embeddings", 4096),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or (arch == "qwen2_moe" and cfg.get("qkv_bias", True))
        or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe") or (arch == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
        llama3_rope_factor=llama3_factor,
        sliding_window=window or None,
        rotary_fraction=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
    )
    if arch in MOE_ARCHS:
        fields.update(_moe_fields(cfg, path))
    if arch == "deepseek_v3":
        fields.update(_mla_fields(cfg, rope, path))
    return ModelShape(**fields)


def _moe_fields(cfg: dict, path: Path) -> dict:
    arch = cfg["model_type"]
    if arch in SIGMOID_MOE_ARCHS:
        return _sigmoid_moe_fields(cfg, path)
    if arch in ("mixtral", "gpt_oss"):
        # Mixtral experts are as wide as `intermediate_size` and always renormalize the top-k weights.
        return dict(experts=cfg["num_local_experts"], topk=cfg["num_experts_per_tok"], moe_ffn=cfg["intermediate_size"],
                    norm_topk=True, aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)))
    # Qwen MoE may interleave dense layers; every released checkpoint has none, and Megatron would need a
    # per-layer name table for them, so they are refused rather than loaded wrong.
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{path}: dense layers between MoE layers (mlp_only_layers "
                         f"{cfg.get('mlp_only_layers')}, decoder_sparse_step {cfg.get('decoder_sparse_step')}) "
                         "are not supported; every layer must be sparse")
    # Qwen3-MoE's config class writes its expert count as `num_local_experts` (an alias of num_experts).
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    return dict(experts=experts, topk=cfg["num_experts_per_tok"], moe_ffn=cfg["moe_intermediate_size"],
                shared_ffn=(cfg.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0,
                shared_gate=arch == "qwen2_moe" and bool(cfg.get("shared_expert_intermediate_size")),
                norm_topk=bool(cfg.get("norm_topk_prob", False)),
                aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)))


def _sigmoid_moe_fields(cfg: dict, path: Path) -> dict:
    """GLM-4.5 and DeepSeek-V3 routing (transformers' Glm4MoeTopkRouter, DeepseekV3TopkRouter): scores =
    sigmoid(logits); the experts are chosen by scores + e_score_correction_bias, within the `topk_group` of
    `n_group` groups whose two best biased scores sum highest; their weights are the chosen unbiased scores,
    renormalized to sum to 1, times `routed_scaling_factor`. `n_shared_experts` ungated experts of the routed
    width always run. The first `first_k_dense_replace` layers are dense. Megatron's router ranks groups by the
    sum of their top `topk / topk_group` scores and always renormalizes: other settings are refused."""
    groups, group_topk, topk = cfg.get("n_group") or 1, cfg.get("topk_group") or 1, cfg["num_experts_per_tok"]
    if groups > 1 and topk // group_topk != 2:
        raise ValueError(f"{path}: num_experts_per_tok {topk} / topk_group {group_topk} must be 2 with n_group "
                         f"{groups} > 1: transformers ranks each group by its two best scores, Megatron by its "
                         "top num_experts_per_tok / topk_group")
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        raise ValueError(f"{path}: norm_topk_prob false is not supported: Megatron's sigmoid router always "
                         "renormalizes the chosen experts' weights")
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0))
    if mtp:
        raise ValueError(f"{path}: num_nextn_predict_layers = {mtp}: multi-token-prediction layers are neither "
                         "trained nor exported by megarl; set it to 0 to train the model without them (its MTP "
                         "weights are then not read)")
    moe_ffn = cfg["moe_intermediate_size"]
    return dict(experts=cfg["n_routed_experts"], topk=topk, moe_ffn=moe_ffn,
                shared_ffn=moe_ffn * (cfg.get("n_shared_experts") or 0), norm_topk=True, moe_score="sigmoid",
                expert_bias=True, moe_groups=groups if groups > 1 else 0, moe_group_topk=group_topk if groups > 1 else 0,
                routed_scale=float(cfg.get("routed_scaling_factor", 1.0)),
                dense_layers=int(cfg.get("first_k_dense_replace") or 0),
                aux_loss_coeff=0.0)


def _mla_fields(cfg: dict, rope: dict, path: Path) -> dict:
    """DeepSeek-V3's multi-latent attention and its (optionally YaRN-scaled, interleaved) RoPE."""
    if cfg.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias true is not supported for deepseek_v3 (Megatron's multi-latent "
                         "attention has no projection biases)")
    if not cfg.get("rope_interleave", True):
        raise ValueError(f"{path}: rope_interleave false is not supported: Megatron's multi-latent attention rotates "
                         "interleaved pairs of the RoPE dims")
    yarn = _yarn_rope(rope, path)
    if yarn is not None and (not yarn.truncate or bool(rope.get("mscale")) != bool(rope.get("mscale_all_dim"))):
        # transformers scales the softmax by mscale_all_dim alone and cos/sin by both; Megatron's MLA by both
        raise ValueError(f"{path}: rope_parameters truncate false, or only one of mscale and mscale_all_dim, is not "
                         "supported for deepseek_v3 (Megatron's multi-latent attention rounds the YaRN band and "
                         "reads the two together)")
    return dict(q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_dim=cfg["qk_nope_head_dim"], qk_rope_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], kv_heads=cfg["num_attention_heads"],
                yarn=yarn)


# What gpt-oss's clamped SwiGLU gates with: Megatron's quick_gelu, x * sigmoid(1.702 x).
_QUICK_GELU_ALPHA = 1.702


def _gpt_oss_shape(cfg: dict, path: Path, rope: dict) -> ModelShape:
    """gpt-oss (transformers' GptOssForCausalLM); what megarl cannot compute exactly is refused by its key."""
    if not cfg.get("attention_bias", True):
        raise ValueError(f"{path}: attention_bias false is not supported for gpt_oss (Megatron gives the attention "
                         "output a bias with the router's and the experts')")
    if cfg.get("swiglu_alpha", _QUICK_GELU_ALPHA) != _QUICK_GELU_ALPHA:
        raise ValueError(f"{path}: swiglu_alpha {cfg['swiglu_alpha']} is not supported (only {_QUICK_GELU_ALPHA}, "
                         "Megatron's quick_gelu)")
    if cfg.get("attention_dropout", 0.0):
        raise ValueError(f"{path}: attention_dropout {cfg['attention_dropout']} is not supported (only 0)")
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    windowed = _windowed_layers(kinds, layers, path)
    if not cfg.get("sliding_window"):
        windowed = ()  # no window: every layer attends causally
    heads = cfg["num_attention_heads"]
    return ModelShape(
        arch="gpt_oss", vocab_size=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=layers, heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 150000.0))),
        max_position=cfg.get("max_position_embeddings", 131072),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=True, qk_norm=False,
        linear_bias=True, attention_sinks=True, local_window=cfg["sliding_window"] if any(windowed) else None,
        window_layers=windowed if any(windowed) else (), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        yarn=_yarn_rope(rope, path), **_moe_fields(cfg, path),
    )


def _yarn_rope(rope: dict, path: Path) -> YarnRope | None:
    """The YaRN parameters of config.json's `rope_parameters` (or `rope_scaling`); None for plain RoPE."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise ValueError(f"{path}: rope_parameters.rope_type {kind!r} is not supported (default, yarn)")
    if rope.get("attention_factor") is not None:
        raise ValueError(f"{path}: rope_parameters.attention_factor is not supported (Megatron derives the YaRN "
                         "attention factor from factor, mscale and mscale_all_dim)")
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        raise ValueError(f"{path}: rope_parameters of rope_type yarn need factor and original_max_position_embeddings")
    both = rope.get("mscale") and rope.get("mscale_all_dim")  # transformers uses them only together
    return YarnRope(factor=float(rope["factor"]), original_max_position=int(rope["original_max_position_embeddings"]),
                    beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                    truncate=bool(rope.get("truncate", True)),
                    mscale=float(rope["mscale"]) if both else None,
                    mscale_all_dim=float(rope["mscale_all_dim"]) if both else None)


LAYER_TYPES = ("sliding_attention", "full_attention")


def _windowed_layers(kinds: list[str], layers: int, path: Path) -> tuple[bool, ...]:
    """Per layer, whether config.json's `layer_types` makes it a sliding-window layer (gpt-oss, Gemma 3)."""
    if len(kinds) != layers or any(kind not in LAYER_TYPES for kind in kinds):
        raise ValueError(f"{path}: layer_types must give each of the {layers} layers one of "
                         f"{', '.join(LAYER_TYPES)}; got {kinds}")
    return tuple(kind == "sliding_attention" for kind in kinds)


def _gemma3_shape(cfg: dict, path: Path) -> ModelShape:
    """Gemma 3's text model (transformers' Gemma3TextConfig): GeGLU, (1 + w) RMSNorms around attention and MLP,
    q/k norms, scaled embeddings, and local (sliding-window) layers between global ones, each kind with its own
    RoPE. Options megarl's Megatron model does not compute are refused by key."""
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    refused = {"attn_logit_softcapping": "attention logit softcapping (Megatron's attention has none)",
               "use_bidirectional_attention": "bidirectional attention", "attention_bias": "attention biases"}
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{path}: {key} = {cfg[key]!r}: {what} is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"{path}: hidden_activation {cfg['hidden_activation']!r} is not supported (gelu_pytorch_tanh)")
    # transformers 5 writes `layer_types` and `rope_parameters` per layer type; older configs have
    # sliding_window_pattern (every n-th layer global), rope_theta, rope_local_base_freq and rope_scaling.
    pattern = cfg.get("sliding_window_pattern", 6)
    kinds = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(layers)]
    windowed = _windowed_layers(kinds, layers, path)
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                                          **(cfg.get("rope_scaling") or {})}
    local = rope.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    for kind, params, allowed in (("full_attention", full, ("default", "linear")), ("sliding_attention", local, ("default",))):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in allowed:
            raise ValueError(f"{path}: rope_parameters.{kind}.rope_type {rope_type!r} is not supported "
                             f"({', '.join(allowed)})")
    linear = full.get("rope_type", full.get("type")) == "linear"
    window = cfg.get("sliding_window") or 0
    if "sliding_attention" in kinds and window < 1:
        raise ValueError(f"{path}: sliding_window {cfg.get('sliding_window')!r}: local layers need a window of >= 1 token")
    return ModelShape(
        arch="gemma3_text",
        vocab_size=cfg["vocab_size"],
        hidden=cfg["hidden_size"],
        layers=layers,
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        max_position=cfg.get("max_position_embeddings", 131_072),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=False,
        qk_norm=True,
        zero_centered_norms=True,
        post_norms=True,
        scaled_embeddings=True,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        window_layers=windowed if any(windowed) else (),
        local_window=window if any(windowed) else None,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
        rope_linear_factor=float(full["factor"]) if linear else None,
        final_logit_softcap=cfg.get("final_logit_softcapping") or None,
    )


def _vlm_shape(cfg: dict, path: Path) -> ModelShape:
    """Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) and Qwen3-VL (Qwen3VLForConditionalGeneration): the text
    model's fields from `text_config` (released Qwen2.5-VL configs keep them at the top level, with `rope_scaling`
    of type "mrope"), the tower's from `vision_config`. What their transformers classes do not compute is refused by
    key."""
    arch = cfg["model_type"]
    text = cfg.get("text_config") or cfg
    vis = cfg.get("vision_config")
    if not isinstance(vis, dict):
        raise ValueError(f"{path}: model_type {arch!r} needs a vision_config mapping")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"{path}: text_config.rope_parameters.rope_type {rope_type!r} is not supported for {arch} "
                         "(default: multimodal RoPE over mrope_section)")
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    section = tuple(rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"{path}: text_config.rope_parameters.mrope_section {list(section)} must be 3 sizes (time, "
                         f"height, width) summing to half the head dim, {head_dim // 2}")
    if text.get("use_sliding_window"):
        raise ValueError(f"{path}: text_config.use_sliding_window true is not supported for {arch}")
    patch, temporal = vis.get("patch_size", 14), vis.get("temporal_patch_size", 2)
    if not isinstance(patch, int) or not isinstance(temporal, int):
        raise ValueError(f"{path}: vision_config.patch_size {patch!r} and temporal_patch_size {temporal!r} must be "
                         "whole numbers (square patches)")
    qwen3 = arch == "qwen3_vl"
    deepstack = tuple(vis.get("deepstack_visual_indexes", (8, 16, 24))) if qwen3 else ()
    if len(deepstack) > text["num_hidden_layers"] or any(not 0 <= i < vis["depth"] for i in deepstack):
        raise ValueError(f"{path}: vision_config.deepstack_visual_indexes {list(deepstack)} must name at most "
                         f"{text['num_hidden_layers']} (text layers) of the {vis['depth']} vision blocks")
    vision = VisionShape(
        depth=vis["depth"], hidden=vis["hidden_size"], heads=vis["num_heads"], ffn=vis["intermediate_size"],
        patch=patch, temporal_patch=temporal, spatial_merge=vis.get("spatial_merge_size", 2),
        out_hidden=vis.get("out_hidden_size", text["hidden_size"]),
        image_token_id=cfg.get("image_token_id", 151655), video_token_id=cfg.get("video_token_id", 151656),
        vision_start_id=cfg.get("vision_start_token_id", 151652), vision_end_id=cfg.get("vision_end_token_id", 151653),
        mrope_section=section, mrope_interleaved=qwen3,
        act=vis.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu"),
        window=0 if qwen3 else vis.get("window_size", 112),
        full_blocks=() if qwen3 else tuple(vis.get("fullatt_block_indexes", (7, 15, 23, 31))),
        position_embeddings=vis.get("num_position_embeddings", 2304) if qwen3 else 0, deepstack_blocks=deepstack,
    )
    if vision.out_hidden != text["hidden_size"]:
        raise ValueError(f"{path}: vision_config.out_hidden_size {vision.out_hidden} must equal the text model's "
                         f"hidden_size {text['hidden_size']} (merged features replace token embeddings)")
    return ModelShape(
        arch=arch, vocab_size=text["vocab_size"], hidden=text["hidden_size"], layers=text["num_hidden_layers"],
        heads=heads, kv_heads=text.get("num_key_value_heads") or heads, head_dim=head_dim,
        ffn=text["intermediate_size"], norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(text.get("rope_theta", rope.get("rope_theta", 5e5 if qwen3 else 1e6))),
        max_position=text.get("max_position_embeddings", 128000 if qwen3 else 32768),
        # transformers ties when either the model's or (Qwen2.5-VL) the text model's config says so
        tied_embeddings=bool(cfg.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
        qkv_bias=not qwen3 or bool(text.get("attention_bias", False)), qk_norm=qwen3, vision=vision,
    )


def padded_vocab_size(vocab_size: int, *, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP ranks: round up to a multiple of `multiple * tp`
    (or keep it when it already divides by tp, so tiny models stay small)."""
    if vocab_size % tp == 0 and (vocab_size // tp) % 8 == 0:
        return vocab_size
    step = multiple * tp
    return -(-vocab_size // step) * step
