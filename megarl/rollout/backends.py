"""The one place a recipe's rollout engine (`rollout.engine`) is chosen."""

from __future__ import annotations

from megarl.config import LoraConfig, RecipeError, RolloutConfig
from megarl.device import current_device, on_gpu
from megarl.models.arch import ModelShape
from megarl.rollout.engine import RolloutEngine, RolloutPeer


def make_rollout_engine(cfg: RolloutConfig, model_dir: str, *, shape: ModelShape, dtype: str, seed: int,
                        capture_routes: bool = False, group=None, lora: LoraConfig | None = None) -> RolloutEngine:
    """The recipe's rollout engine (`rollout.engine`) over the HF checkpoint `model_dir` (of architecture
    `shape`), sampling with `seed`;
    with `capture_routes` (MoE models) it returns each token's experts (Generation.routes). `group`: the
    trainer ranks on the engine's devices, this one first, which hand SGLang their own copies of the pushed
    weights (`make_rollout_peer` on the others); None when the engine is fed from this rank alone. `lora`: the
    policy's adapters arrive by `update_adapter` (rollout.lora_sync: adapter), and the engine keeps its base
    weights on the device when it releases its memory (the adapters are applied over them)."""
    match cfg.engine:
        case "native":
            from megarl.rollout.native import NativeEngine

            return NativeEngine(model_dir, dtype=dtype, seed=seed, capture_routes=capture_routes,
                                keep_weights=lora is not None)
        case "sglang":
            from megarl.rollout.sglang_engine import SGLangEngine

            return SGLangEngine(model_dir, shape=shape, dtype=dtype, seed=seed, tp_size=cfg.tp, mem_fraction=cfg.mem_fraction,
                                base_gpu_id=current_device().index if on_gpu() else 0,
                                capture_routes=capture_routes, group=group, timeout_s=cfg.engine_timeout_s,
                                lora=lora)
    raise RecipeError(f"rollout.engine: unknown engine {cfg.engine!r}")


def make_rollout_peer(cfg: RolloutConfig, group) -> RolloutPeer | None:
    """What a rank beside an engine's host runs in every weight push (`push(named_tensors, bucket_bytes=)`), or
    None where the host alone feeds its engine: an SGLang engine takes each device's payload from the trainer
    rank on that device; the native engine lives in its host's process."""
    match cfg.engine:
        case "native":
            return None
        case "sglang":
            from megarl.rollout.sglang_transfer import SGLangPeer

            return SGLangPeer(group)
    raise RecipeError(f"rollout.engine: unknown engine {cfg.engine!r}")

