"""The one place a recipe's rollout engine (`rollout.engine`) is chosen."""

from __future__ import annotations

from megarl.config import LoraConfig, RecipeError, RolloutConfig
from megarl.device import current_device, on_gpu
from megarl.models.arch import ModelShape
from megarl.rollout.engine import RolloutEngine, RolloutPeer


def make_rollout_engine(cfg: RolloutConfig, model_dir: str, *, shape: ModelShape, dtype: str, seed: int,
                        capture_routes: bool = False, group=None, lora: LoraConfig | None = None,
                        nodes: int = 1, init_addr: str | None = None) -> RolloutEngine:
    """The recipe's rollout engine (`rollout.engine`) over the HF checkpoint `model_dir` (of architecture
    `shape`), sampling with `seed`;
    with `capture_routes` (MoE models) it returns each token's experts (Generation.routes). `group`: the
    trainer ranks on the engine's devices, this one first, which hand SGLang their own copies of the pushed
    weights (`make_rollout_peer` on the others); None when the engine is fed from this rank alone. `lora`: the
    policy's adapters arrive by `update_adapter` (rollout.lora_sync: adapter), and the engine keeps its base
    weights on the device when it releases its memory (the adapters are applied over them). `nodes` > 1: an
    SGLang engine over that many whole nodes, this rank starting node 0 (`make_rollout_node_part` the others),
    the nodes meeting at `init_addr` (megarl.rollout.placement.share_init_addr)."""
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
                                lora=lora, nnodes=nodes, dist_init_addr=init_addr)
    raise RecipeError(f"rollout.engine: unknown engine {cfg.engine!r}")


def make_rollout_node_part(cfg: RolloutConfig, model_dir: str, *, dtype: str, seed: int, nodes: int, node_rank: int,
                           init_addr: str, capture_routes: bool = False, lora: LoraConfig | None = None):
    """Node `node_rank` (>= 1) of an SGLang engine over `nodes` whole nodes, on the node's first rank, started
    while the engine's host starts node 0 with the same arguments (megarl.rollout.sglang_launch.SGLangNodePart)."""
    if cfg.engine != "sglang":
        raise RecipeError(f"rollout.engine: a {cfg.engine} engine does not span nodes")
    from megarl.rollout.sglang_launch import SGLangNodePart

    return SGLangNodePart(model_dir, dtype=dtype, seed=seed, tp_size=cfg.tp, nnodes=nodes, node_rank=node_rank,
                          dist_init_addr=init_addr, mem_fraction=cfg.mem_fraction,
                          base_gpu_id=current_device().index if on_gpu() else 0, capture_routes=capture_routes,
                          lora=lora)


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

