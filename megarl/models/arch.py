"""What megarl needs to know about a HuggingFace checkpoint, read from its config.json alone.

`ModelShape` is the architecture-independent description (sizes, norms, RoPE, biases, tying, experts) that
both the Megatron model builder and the weight name tables work from. Reading it needs no torch or
transformers, so recipe checks and planning stay cheap.

Mixture-of-experts routing, as transformers computes it: router logits -> softmax over all experts -> top-k;
with `norm_topk` (Mixtral always, Qwen MoE when `norm_topk_prob`) the k probabilities are renormalized to sum
to 1, which equals a softmax over the k selected logits. Qwen2-MoE adds a shared expert whose output is
scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

DENSE_ARCHS = ("qwen2", "llama", "mistral", "qwen3")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ARCHS = DENSE_ARCHS + MOE_ARCHS
SUPPORTED_ARCHS += ("gemma3_text",)  # Gemma 3's text model: its own shape reader and layer (megarl.engine.gemma)


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
    # Gemma 3 (megarl.engine.gemma); the defaults are every other architecture's
    activation: str = "silu"  # gated MLP activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation)
    zero_centered_norms: bool = False  # every RMSNorm scales by (1 + weight), the weight stored as HF stores it
    post_norms: bool = False  # attention and MLP outputs are normed before their residual add
    scaled_embeddings: bool = False  # embeddings multiplied by sqrt(hidden), in the embedding dtype
    attention_scale: float | None = None  # softmax scale of q k^T; None = head_dim ** -0.5
    window_layers: tuple[bool, ...] = ()  # per layer, True: local attention over the last `local_window` tokens
    local_window: int = 0     # tokens a local layer's query sees, itself included
    local_rope_theta: float | None = None  # RoPE base of the local layers (rope_theta: the global ones')
    rope_linear_factor: float | None = None  # global layers' linear RoPE scaling: positions divided by it
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


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
    if arch == "gemma3":
        raise ValueError(f"{path}: model_type 'gemma3' is Gemma 3 with its vision tower (Gemma3ForConditionalGeneration), "
                         "which is not supported; the text model alone (model_type 'gemma3_text', Gemma3ForCausalLM) is")
    if arch == "gemma3_text":
        return _gemma3_shape(cfg, path)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    llama3_factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "llama3" else None
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "llama3", None):
        raise ValueError(f"{path}: rope type {rope.get('rope_type')!r} is not supported (default, llama3)")
    # Mistral and Mixtral apply `sliding_window` whenever it is set; Qwen models only with use_sliding_window.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in ("mistral", "mixtral")) else None
    return ModelShape(
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
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        llama3_rope_factor=llama3_factor,
        sliding_window=window or None,
        **(_moe_fields(cfg, path) if arch in MOE_ARCHS else {}),
    )


def _moe_fields(cfg: dict, path: Path) -> dict:
    arch = cfg["model_type"]
    if arch == "mixtral":
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
                norm_topk=bool(cfg.get("norm_topk_prob", False)),
                aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0)))


GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


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
    if len(kinds) != layers or any(kind not in GEMMA3_LAYER_TYPES for kind in kinds):
        raise ValueError(f"{path}: layer_types must give each of the {layers} layers one of "
                         f"{', '.join(GEMMA3_LAYER_TYPES)}; got {kinds}")
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
        activation="gelu_tanh",
        zero_centered_norms=True,
        post_norms=True,
        scaled_embeddings=True,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        window_layers=tuple(kind == "sliding_attention" for kind in kinds),
        local_window=window,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
        rope_linear_factor=float(full["factor"]) if linear else None,
        final_logit_softcap=cfg.get("final_logit_softcapping") or None,
    )


def padded_vocab_size(vocab_size: int, *, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP ranks: round up to a multiple of `multiple * tp`
    (or keep it when it already divides by tp, so tiny models stay small)."""
    if vocab_size % tp == 0 and (vocab_size // tp) % 8 == 0:
        return vocab_size
    step = multiple * tp
    return -(-vocab_size // step) * step
