"""Starting a run: the model and the parallel layout are checked against this launch before anything is
built, then Megatron's parallel state starts. Shared by the RL, SFT and DPO loops, and by the rollout ranks of
placement split (megarl.loops.split), which check the same layout."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megarl.config import Config, RecipeError
from megarl.engine import model
from megarl.engine.model import check_megatron_fields
from megarl.engine.parallel import ParallelGroups, init_parallel
from megarl.layout import Layout
from megarl.models.arch import read_shape

log = logging.getLogger(__name__)


@functools.cache
def job_store(timeout_minutes: float) -> tuple[dist.Store, int, int]:
    """torchrun's store, this process's rank and the job's world size (once per process), for placement split,
    whose rollout ranks stay outside torch.distributed's world."""
    if "RANK" not in os.environ:
        raise RecipeError("placement.mode = 'split' runs rollout ranks beside the training ranks: launch it under "
                          "torchrun with more processes than placement.rollout_ranks")
    return next(dist.rendezvous("env://", timeout=timedelta(minutes=timeout_minutes)))


def job_world(cfg: Config) -> tuple[int, int]:
    """(ranks of the job, ranks per node) as this process sees them. The ranks: with placement split those of
    torchrun's rendezvous (training and rollout ranks), else torch.distributed's world once it is up, else
    torchrun's WORLD_SIZE (1 outside torchrun). Per node: torchrun's LOCAL_WORLD_SIZE (the whole job outside
    torchrun)."""
    if cfg.placement.rollout_ranks:  # placement split (0 otherwise: checked by Config)
        world = job_store(cfg.parallel.timeout_minutes)[2]
    else:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def launch_layout(cfg: Config, *, world: int, ranks_per_node: int) -> Layout:
    """The recipe's layout on a job of `world` ranks, `ranks_per_node` to a node (megarl.layout.Layout.of, the
    check `megarl plan` makes too): a LayoutError (a RecipeError) names the keys and both numbers, and a model
    whose config.json cannot be read is a RecipeError naming model.path (teacher.path for the teacher's)."""
    shapes = {}
    for key, path in (("model.path", cfg.model.path), ("teacher.path", cfg.teacher.path)):
        try:
            shapes[key] = read_shape(path) if path is not None else None
        except ValueError as e:
            raise RecipeError(f"{key}: {e}") from None
    return Layout.of(cfg, shapes["model.path"], world=world, ranks_per_node=ranks_per_node,
                     teacher=shapes["teacher.path"])


def init_groups(cfg: Config) -> ParallelGroups:
    """Check the model and the parallel layout against this launch, then start the parallel state.
    A mismatch is a RecipeError naming the keys, raised before any model is built, and so is a run_dir
    that cannot be written. With placement split the training ranks meet as a world of their own, through
    their prefix of torchrun's store."""
    world, ranks_per_node = job_world(cfg)
    layout = launch_layout(cfg, world=world, ranks_per_node=ranks_per_node)
    trainer_store = None
    if layout.rollout_ranks and not dist.is_initialized():
        store, rank, _ = job_store(cfg.parallel.timeout_minutes)
        trainer_store = (dist.PrefixStore("megarl/trainer/", store), rank, layout.world)
    check_megatron_fields(cfg.model.megatron)
    check_run_dir(cfg.run_dir)
    choose_layers(cfg)
    par = cfg.parallel
    try:
        return init_parallel(tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp, seed=cfg.seed,
                             timeout=timedelta(minutes=par.timeout_minutes), trainer_store=trainer_store)
    except ValueError as e:
        raise RecipeError(f"parallel: {e}") from None


def choose_layers(cfg: Config) -> None:
    """The layers and kernels of this run's models, before any is built.

    - model.lora: Megatron's local layer spec, where Transformer Engine's would be used otherwise (a GPU with TE
      installed, as in megarl's image): the adapters wrap the local linears. Said once, since the local layers
      are slower on a GPU than TE's fused ones.
    - train.share_prompts: RoPE unfused (model.megatron.apply_rope_fusion false): a shared row is rotated by its
      position ids, own tokens continuing after their prompt, where the fused kernel restarts them at every
      segment. Its attention is megarl's local one or TE's (megarl.engine.te_attention)."""
    if cfg.train.share_prompts:
        if cfg.model.megatron.get("apply_rope_fusion"):
            raise RecipeError("model.megatron.apply_rope_fusion: true cannot be combined with train.share_prompts "
                              "(the fused RoPE kernel restarts positions at every segment of a packed row, where a "
                              "shared row's own tokens continue after their prompt)")
        cfg.model.megatron["apply_rope_fusion"] = False
    if cfg.model.lora is None:
        return
    te = model.uses_transformer_engine()
    model.use_local_layers("model.lora")
    if te:
        log.warning("model.lora runs on Megatron's local layer spec: Transformer Engine is installed but not used "
                    "by this run (its fused norm-and-linear layers take no adapters)")


def check_run_dir(run_dir: str) -> None:
    """Create `run_dir` and write a file in it now, so that a directory the run cannot write is a RecipeError
    naming `run_dir` before any work, not a traceback at the first checkpoint."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise RecipeError(f"run_dir: cannot write to {run_dir}: {e.strerror or e}") from None
