"""Starting a run: the run is resolved against this launch (megarl.job) before anything is built, then
Megatron's parallel state starts. Shared by the RL, SFT, DPO and RM loops, and by the rollout ranks of
placement split (megarl.loops.split), which resolve the same run."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import yaml

from megarl.config import Config, RecipeError
from megarl.engine.model import uses_transformer_engine
from megarl.engine.parallel import ParallelGroups, init_parallel
from megarl.envs.environment import environment_factory
from megarl.job import Job, check_same_tokenizer
from megarl.rewards.terms import build_terms

log = logging.getLogger(__name__)


@functools.cache
def job_store(timeout_minutes: float) -> tuple[dist.Store, int, int]:
    """torchrun's store, this process's rank and the job's world size (once per process), for placement split,
    whose rollout ranks stay outside torch.distributed's world. The store is torchrun's agent's, which outlives
    the processes when torchrun starts them again (--max-restarts): each start has keys of its own, or a new
    process would read the addresses and commands of a dead one."""
    if "RANK" not in os.environ:
        raise RecipeError("placement.mode = 'split' runs rollout ranks beside the training ranks: launch it under "
                          "torchrun with more processes than placement.rollout_ranks")
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(minutes=timeout_minutes)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megarl/start{attempt}/", store), rank, world


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


def resolve_job(cfg: Config) -> Job:
    """The run of `cfg` on this launch's ranks (`job_world`), resolved once (megarl.job.Job.of: the check `megarl
    plan` makes too), on this machine's Transformer Engine where it is usable; then the code the recipe names
    must import (an RL run's reward terms and environment) and a distillation teacher must share the student's
    tokenizer. A RecipeError names the keys and the numbers."""
    world, ranks_per_node = job_world(cfg)
    job = Job.of(cfg, world=world, ranks_per_node=ranks_per_node, transformer_engine=uses_transformer_engine())
    if not cfg.algo.traits.offline:
        build_terms(cfg.reward)  # a custom reward that does not import stops here, before any work
        environment_factory(cfg.env)  # and so does an environment
        if cfg.teacher.path is not None:
            check_same_tokenizer(cfg.model.path, cfg.teacher.path)
    if cfg.model.lora is not None and uses_transformer_engine():
        log.warning("model.lora runs on Megatron's local layer spec: Transformer Engine is installed but not used "
                    "by this run (its fused norm-and-linear layers take no adapters)")
    return job


def launch(cfg: Config) -> tuple[Job, ParallelGroups]:
    """Resolve the run (`resolve_job`), then start the parallel state (`start_parallel`)."""
    job = resolve_job(cfg)
    return job, start_parallel(job)


def start_parallel(job: Job) -> ParallelGroups:
    """Megarl's parallel state for the resolved `job`; `run_dir/job.yaml` records what was resolved. A run_dir
    that cannot be written is a RecipeError naming it, raised before any model is built. With placement split
    the training ranks meet as a world of their own, through their prefix of torchrun's store. Under torchrun the
    world meets through keys of this start's own (`job_store`): with torchrun's env:// the processes torchrun
    starts again after a failure (--max-restarts) would read the dead ones' addresses and fail to connect."""
    cfg = job.cfg
    trainer_store = None
    if "RANK" in os.environ and not dist.is_initialized():
        store, rank, world = job_store(cfg.parallel.timeout_minutes)
        trainer_store = (dist.PrefixStore("megarl/trainer/", store), rank,
                         job.layout.world if job.layout.rollout_ranks else world)
    check_run_dir(cfg.run_dir)
    par = cfg.parallel
    try:
        groups = init_parallel(tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp, cp=par.cp, seed=cfg.seed,
                               timeout=timedelta(minutes=par.timeout_minutes), trainer_store=trainer_store)
    except ValueError as e:
        raise RecipeError(f"parallel: {e}") from None
    if dist.get_rank() == 0:
        (Path(cfg.run_dir) / "job.yaml").write_text(
            "# what megarl resolved for this run (megarl.job): the recipe as written is recipe.yaml\n"
            + yaml.safe_dump(job.resolved(), sort_keys=False))
    return groups


def check_run_dir(run_dir: str) -> None:
    """Create `run_dir` and write a file in it now, so that a directory the run cannot write is a RecipeError
    naming `run_dir` before any work, not a traceback at the first checkpoint."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise RecipeError(f"run_dir: cannot write to {run_dir}: {e.strerror or e}") from None
