"""Starting a run: the model and the parallel layout are checked against this launch before anything is
built, then Megatron's parallel state starts. Shared by the RL, SFT and DPO loops."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megarl.config import Config, RecipeError
from megarl.engine.model import check_megatron_fields
from megarl.engine.parallel import ParallelGroups, init_parallel
from megarl.layout import check_layout
from megarl.models.arch import read_shape


def init_groups(cfg: Config) -> ParallelGroups:
    """Check the model and the parallel layout against this launch, then start the parallel state.
    A mismatch is a RecipeError naming the keys, raised before any model is built, and so is a run_dir
    that cannot be written."""
    try:
        shape = read_shape(cfg.model.path)
    except ValueError as e:
        raise RecipeError(f"model.path: {e}") from None
    par = cfg.parallel
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    trainer_store = None
    if cfg.placement.mode == "split" and not dist.is_initialized():
        from megarl.loops.split import trainer_world

        trainer_store = trainer_world(cfg)
        world_size = trainer_store[2]
    check_megatron_fields(cfg.model.megatron)
    try:
        check_layout(shape, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, world_size=world_size,
                     vpp=cfg.model.megatron.get("virtual_pipeline_model_parallel_size") or 1,
                     sequence_parallel=bool(cfg.model.megatron.get("sequence_parallel")))
    except ValueError as e:
        raise RecipeError(str(e)) from None
    check_run_dir(cfg.run_dir)
    try:
        return init_parallel(tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp, seed=cfg.seed,
                             timeout=timedelta(minutes=par.timeout_minutes), trainer_store=trainer_store)
    except ValueError as e:
        raise RecipeError(f"parallel: {e}") from None


def check_run_dir(run_dir: str) -> None:
    """Create `run_dir` and write a file in it now, so that a directory the run cannot write is a RecipeError
    naming `run_dir` before any work, not a traceback at the first checkpoint."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise RecipeError(f"run_dir: cannot write to {run_dir}: {e.strerror or e}") from None
