"""What megarl needs to know about a HuggingFace checkpoint, read from its config.json alone.

`ModelShape` is the architecture-independent description (sizes, norms, RoPE, biases, tying) that both the
Megatron model builder and the weight name tables work from. Reading it needs no torch or transformers, so
recipe checks and planning stay cheap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHS = ("qwen2", "llama", "mistral", "qwen3")


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


def read_shape(model_dir: str | Path) -> ModelShape:
    """Parse `model_dir/config.json`; an unsupported architecture is a ValueError naming the file."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: model_type {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    llama3_factor = rope.get("factor") if rope.get("rope_type", rope.get("type")) == "llama3" else None
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "llama3", None):
        raise ValueError(f"{path}: rope type {rope.get('rope_type')!r} is not supported (default, llama3)")
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
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        llama3_rope_factor=llama3_factor,
    )


def padded_vocab_size(vocab_size: int, *, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP ranks: round up to a multiple of `multiple * tp`
    (or keep it when it already divides by tp, so tiny models stay small)."""
    if vocab_size % tp == 0 and (vocab_size // tp) % 8 == 0:
        return vocab_size
    step = multiple * tp
    return -(-vocab_size // step) * step


def check_layout(shape: ModelShape, *, tp: int, pp: int, cp: int, world_size: int) -> None:
    """The parallel layout must split this model and this world evenly; ValueError says which number
    does not divide which (keys as in the recipe's `parallel:` section)."""
    checks = [
        (world_size, tp * pp * cp, f"world size {world_size}", f"parallel.tp * parallel.pp * parallel.cp = {tp * pp * cp}"),
        (shape.heads, tp, f"attention heads {shape.heads}", f"parallel.tp = {tp}"),
        (shape.kv_heads, tp, f"key/value heads (query groups) {shape.kv_heads}", f"parallel.tp = {tp}"),
        (shape.ffn, tp, f"MLP width {shape.ffn}", f"parallel.tp = {tp}"),
        (shape.layers, pp, f"layers {shape.layers}", f"parallel.pp = {pp}"),
    ]
    for number, divisor, what, by in checks:
        if number % divisor:
            raise ValueError(f"{what} is not divisible by {by}")
