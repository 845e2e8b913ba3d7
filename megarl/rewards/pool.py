"""Reward scoring on a pool of Ray workers: `reward.workers: N` on a local Ray instance that megarl starts
(N CPUs), or on the cluster at `reward.ray_address`. Ray is imported only here, when a pool is built.

Samples go to the workers in chunks, one Ray task each, as soon as a chunk is full (megarl.rewards.scorer.
Scoring), so scoring runs while the rest of the batch is still being generated; a task rebuilds the terms
from the recipe's RewardConfig in its worker and runs the same `score_samples` as the trainer would, so the
outcomes are the same as in-process scoring. A worker that dies mid-task (a segfault, os._exit, the OOM
killer) has its task retried on a fresh worker; a chunk that still fails, or is not back by its deadline,
gives a failed outcome for each of its samples, which the scorer's failure policy turns into 0.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence

from megarl.config import RecipeError, RewardConfig
from megarl.rewards.terms import Outcome, Sample, build_terms, score_samples

TASK_RETRIES = 1  # fresh workers a chunk gets after the one running it dies
# Smaller chunks keep all workers busy when samples take uneven times, and leave for the workers sooner
# while the rest of the batch is generated.
CHUNKS_PER_WORKER = 4
STARTUP_S = 60.0  # slack in a chunk's deadline for starting a worker and importing the rewards


def _score_chunk(cfg: RewardConfig, samples: list[Sample]) -> list[Outcome]:
    return score_samples(build_terms(cfg), samples, timeout_s=cfg.timeout_s)


def start_ray(address: str | None, *, workers: int) -> None:
    """Connect to the cluster at `address`, or start a local Ray instance with `workers` CPUs."""
    import ray

    local = {} if address else dict(
        num_cpus=workers, object_store_memory=128 * 2**20,
        # Workers import custom reward functions by name, so they get the trainer's import path: a function
        # the trainer can import, its workers can. On a cluster, the cluster's own setup decides.
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, **local)


class RayPool:
    def __init__(self, cfg: RewardConfig):
        try:
            import ray
        except ImportError:
            raise RecipeError("reward.workers: scoring on workers needs Ray: pip install -e '.[ray]' "
                              "-c constraints.txt in the megarl checkout") from None
        self.cfg, self.ray = cfg, ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            start_ray(cfg.ray_address, workers=cfg.workers)
        self.task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(_score_chunk)

    def chunk_size(self, n: int) -> int:
        """Samples per task for a batch of `n`: about CHUNKS_PER_WORKER tasks per worker."""
        return math.ceil(n / max(1, min(n, self.cfg.workers * CHUNKS_PER_WORKER)))

    def submit(self, samples: list[Sample]):
        """Start scoring `samples` on a worker now; returns the task's reference for `collect`."""
        return self.task.remote(self.cfg, samples)

    def collect(self, refs: Sequence, sizes: Sequence[int]) -> tuple[list[list[Outcome]], int]:
        """The outcomes of each submitted task (`sizes[k]` samples in task k), waiting for those still running,
        and how many samples had theirs back already when this was called."""
        ray = self.ray
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        ready = set(ready)
        scored_before = sum(size for ref, size in zip(refs, sizes) if ref in ready)
        # Each sample is bounded by the per-sample timer inside the worker; this deadline catches what a
        # signal cannot interrupt (a hang inside C code) and the retries, and covers every task at once.
        # It counts from now, which only lengthens it for tasks that started earlier.
        waves = math.ceil(len(refs) / self.cfg.workers)
        deadline_s = (TASK_RETRIES + 1) * waves * (max(sizes) * self.cfg.timeout_s + STARTUP_S)
        ray.wait(list(refs), num_returns=len(refs), timeout=deadline_s)
        outcomes: list[list[Outcome]] = []
        for ref, size in zip(refs, sizes):
            try:
                outcomes.append(ray.get(ref, timeout=0))
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref, force=True)
                outcomes.append([(math.nan, f"reward worker did not answer within {deadline_s:.0f} s")] * size)
            except ray.exceptions.RayError as e:
                outcomes.append([(math.nan, f"reward worker failed: {type(e).__name__}: {str(e)[:500]}")] * size)
        return outcomes, scored_before

    def close(self) -> None:
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
