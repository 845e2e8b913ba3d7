"""The one place a recipe's rollout engine (`rollout.engine`) is chosen."""

from __future__ import annotations

from megarl.config import RecipeError, RolloutConfig
from megarl.device import current_device, on_gpu
from megarl.rollout.engine import RolloutEngine


def make_rollout_engine(cfg: RolloutConfig, model_dir: str, *, dtype: str, seed: int,
                        capture_routes: bool = False) -> RolloutEngine:
    """The recipe's rollout engine (`rollout.engine`) over the HF checkpoint `model_dir`, sampling with `seed`;
    with `capture_routes` (MoE models) it returns each token's experts (Generation.routes)."""
    match cfg.engine:
        case "native":
            from megarl.rollout.native import NativeEngine

            return NativeEngine(model_dir, dtype=dtype, seed=seed, capture_routes=capture_routes)
        case "sglang":
            from megarl.rollout.sglang_engine import SGLangEngine

            return SGLangEngine(model_dir, dtype=dtype, seed=seed, tp_size=cfg.tp, mem_fraction=cfg.mem_fraction,
                                base_gpu_id=current_device().index if on_gpu() else 0,
                                capture_routes=capture_routes)
    raise RecipeError(f"rollout.engine: unknown engine {cfg.engine!r}")


def captures_routes(cfg: RolloutConfig) -> bool:
    """Whether the recipe's engine returns MoE routes on this machine: SGLang's CPU mode cannot (it page-locks its
    routes buffer with a CUDA call; megarl.rollout.sglang_engine._check_cpu_route_capture)."""
    return cfg.engine == "native" or on_gpu()
