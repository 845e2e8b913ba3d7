"""Reward scoring on a pool of Ray workers: `reward.workers: N` on a local Ray instance that megarl starts
(N CPUs), or on the cluster at `reward.ray_address`. Ray is imported only here, when a pool is built.

A batch is cut into contiguous chunks, one Ray task each; a task rebuilds the terms from the recipe's
RewardConfig in its worker and runs the same `score_samples` as the trainer would, so the outcomes are the
same as in-process scoring. A worker that dies mid-task (a segfault, os._exit, the OOM killer) has its task
retried on a fresh worker; a chunk that still fails, or is not back by its deadline, gives a failed outcome
for each of its samples, which the scorer's failure policy turns into 0.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence

from megarl.config import RecipeError, RewardConfig
from megarl.rewards.scorer import Outcome, Sample, build_terms, score_samples

TASK_RETRIES = 1  # fresh workers a chunk gets after the one running it dies
CHUNKS_PER_WORKER = 2  # smaller chunks keep all workers busy when samples take uneven times
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
            raise RecipeError("reward.workers: scoring on workers needs Ray: pip install 'megarl[ray]'") from None
        self.cfg, self.ray = cfg, ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            start_ray(cfg.ray_address, workers=cfg.workers)
        self.task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(_score_chunk)

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        ray = self.ray
        n_chunks = max(1, min(len(samples), self.cfg.workers * CHUNKS_PER_WORKER))
        bounds = [len(samples) * i // n_chunks for i in range(n_chunks + 1)]
        chunks = [list(samples[a:b]) for a, b in zip(bounds, bounds[1:])]
        refs = [self.task.remote(self.cfg, chunk) for chunk in chunks]
        # Each sample is bounded by the per-sample timer inside the worker; this deadline catches what a
        # signal cannot interrupt (a hang inside C code) and the retries, and covers every chunk at once.
        waves = math.ceil(n_chunks / self.cfg.workers)
        deadline_s = (TASK_RETRIES + 1) * waves * (max(map(len, chunks)) * self.cfg.timeout_s + STARTUP_S)
        ray.wait(refs, num_returns=len(refs), timeout=deadline_s)
        outcomes: list[Outcome] = []
        for ref, chunk in zip(refs, chunks):
            try:
                outcomes += ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref, force=True)
                outcomes += [(math.nan, f"reward worker did not answer within {deadline_s:.0f} s")] * len(chunk)
            except ray.exceptions.RayError as e:
                outcomes += [(math.nan, f"reward worker failed: {type(e).__name__}: {str(e)[:500]}")] * len(chunk)
        return outcomes

    def close(self) -> None:
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
