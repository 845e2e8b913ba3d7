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

import json
from dataclasses import dataclass
from pathlib import Path

DENSE_ARCHS = ("qwen2", "llama", "mistral", "qwen3")
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ARCHS = DENSE_ARCHS + MOE_ARCHS


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

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def read_shape(model_dir: str | Path) -> ModelShape:
    """Parse `model_dir/config.json`; an unsupported architecture is a ValueError naming the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not an HF checkpoint directory: it has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    arch = cfg.get("model_type")
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


def padded_vocab_size(vocab_size: int, *, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP ranks: round up to a multiple of `multiple * tp`
    (or keep it when it already divides by tp, so tiny models stay small)."""
    if vocab_size % tp == 0 and (vocab_size // tp) % 8 == 0:
        return vocab_size
    step = multiple * tp
    return -(-vocab_size // step) * step


def check_layout(shape: ModelShape, *, tp: int, pp: int, cp: int, world_size: int, ep: int = 1,
                 sequence_parallel: bool = False, vpp: int = 1) -> None:
    """The parallel layout must split this model and this world evenly; ValueError says which number
    does not divide which (keys as in the recipe's `parallel:` section).

    Expert parallelism splits the experts over `ep` ranks; Megatron lays those ranks out inside each
    pipeline stage next to the expert tensor-parallel ranks (as many as tp), so tp * ep * pp must divide the
    world as well. `vpp` is the number of virtual pipeline stages (`check_virtual_stages`).
    """
    check_virtual_stages(vpp, layers=shape.layers, pp=pp)
    if ep > 1 and not shape.is_moe:
        raise ValueError(f"parallel.ep = {ep} needs a mixture-of-experts model; {shape.arch} has no experts")
    if shape.is_moe and tp > 1 and not sequence_parallel:
        # Megatron refuses to train MoE layers under tensor parallelism without it (its MoE layer checks
        # at the first training step); on CPU too, where megarl's RMSNorm carries sequence parallelism
        raise ValueError(f"parallel.tp = {tp} with a mixture-of-experts model ({shape.arch}) needs "
                         f"model.megatron.sequence_parallel: true")
    checks = [
        (world_size, tp * pp * cp, f"world size {world_size}",
         f"parallel.tp * parallel.pp * parallel.cp = {tp * pp * cp}"),
        (shape.heads, tp, f"attention heads {shape.heads}", f"parallel.tp = {tp}"),
        (shape.kv_heads, tp, f"key/value heads (query groups) {shape.kv_heads}", f"parallel.tp = {tp}"),
        (shape.ffn, tp, f"MLP width {shape.ffn}", f"parallel.tp = {tp}"),
        (shape.layers, pp, f"layers {shape.layers}", f"parallel.pp = {pp}"),
    ]
    if shape.is_moe:
        checks += [
            (shape.experts, ep, f"experts {shape.experts}", f"parallel.ep = {ep}"),
            (world_size, tp * ep * pp, f"world size {world_size}",
             f"parallel.tp * parallel.ep * parallel.pp = {tp * ep * pp}"),
            (shape.moe_ffn, tp, f"expert MLP width {shape.moe_ffn}", f"parallel.tp = {tp}"),
            (shape.shared_ffn, tp, f"shared expert MLP width {shape.shared_ffn}", f"parallel.tp = {tp}"),
        ]
    for number, divisor, what, by in checks:
        if number % divisor:
            raise ValueError(f"{what} is not divisible by {by}")


def check_virtual_stages(vpp: int, *, layers: int, pp: int) -> None:
    """Virtual pipeline stages (`model.megatron.virtual_pipeline_model_parallel_size`) cut each of the pp
    pipeline stages into vpp model chunks that the interleaved schedule visits in turn: it needs pp >= 2
    and the same number of layers in every one of the pp * vpp chunks. ValueError names the numbers."""
    key = "model.megatron.virtual_pipeline_model_parallel_size"
    if vpp == 1:
        return
    if vpp < 1:
        raise ValueError(f"{key} = {vpp} must be at least 1")
    if pp < 2:
        raise ValueError(f"{key} = {vpp} needs parallel.pp >= 2, got parallel.pp = {pp}")
    if layers % (pp * vpp):
        raise ValueError(f"layers {layers} is not divisible by parallel.pp * {key} = {pp} * {vpp} = {pp * vpp}")
