"""The recipe's reward: weighted terms built once, scored per sample in this process or on a Ray pool, and
the failure policy, which lives here only: a sample whose reward raises, returns something that is not a
number, runs past `reward.timeout_s` or is not finite scores 0, is counted, and the first one of a batch is
logged and kept (`Scorer.first_failure`); the same holds for a sample whose environment's step reward is
not a finite number (`Scoring.fail`; the environment's reward is 0 too). A failed sample never ends the run;
the RL loop stops after `reward.max_failed_steps` consecutive steps in which every sample failed
(megarl.loops.rl).

    scorer = Scorer(cfg.reward)                       # RecipeError now if a custom function does not import
    rewards, failures = scorer(samples)               # list[float] [B], int
    scoring = scorer.batch(B)                         # or sample by sample, as generation finishes each
    scoring.submit(i, sample)                         # ... for every i; on a pool, scoring starts now
    rewards, failures, scored_before = scoring.result()
    scorer.close()
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

from megarl import inject
from megarl.config import RewardConfig
from megarl.rewards.terms import Outcome, Sample, build_terms, score_samples

log = logging.getLogger(__name__)


def settle(outcomes: Sequence[Outcome], samples: Sequence[Sample]) -> tuple[list[float], int, str | None]:
    """Rewards [B] with every failed sample at 0.0, the number of failures and the first failure (its
    reason and response; None without one), which is logged."""
    failed = [i for i, (_, why) in enumerate(outcomes) if why is not None]
    if not failed:
        return [value for value, _ in outcomes], 0, None
    i = failed[0]
    first = f"{outcomes[i][1]}, on response {samples[i].response[:200]!r}"
    log.warning("%d of %d rewards failed and score 0; the first: %s", len(failed), len(outcomes), first)
    return [0.0 if why is not None else value for value, why in outcomes], len(failed), first


class RewardFailure(RuntimeError):
    """Every sample's reward failed in `reward.max_failed_steps` consecutive steps."""


class Scorer:
    """The recipe's reward over a batch of samples, in this process or, with `reward.workers > 0`, on a pool
    of Ray workers (same outcomes, scored in parallel)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.terms = build_terms(cfg)  # fails at launch, naming the key, rather than on every sample
        self.first_failure: str | None = None  # of the last batch scored: the term's key, why, the response
        if cfg.workers:
            from megarl.rewards.pool import RayPool

            self.pool = RayPool(cfg)
        else:
            self.pool = None

    def batch(self, n: int) -> Scoring:
        """A batch of `n` samples to hand in one by one as their responses are final (see Scoring)."""
        return Scoring(self, n)

    def __call__(self, samples: Sequence[Sample]) -> tuple[list[float], int]:
        scoring = self.batch(len(samples))
        for i, sample in enumerate(samples):
            scoring.submit(i, sample)
        rewards, failures, _ = scoring.result()
        return rewards, failures

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class Scoring:
    """The rewards of one batch of `n` samples, handed in by index, in any order, while the rest are still
    being generated.

    On a pool, samples leave for the workers as soon as a chunk of them is full, so scoring overlaps
    generation; `result()` sends the last partial chunk and waits for the rest. In this process, samples
    are scored when `result()` is called: scoring here would hold up the generation that hands them in.
    Outcomes depend on each sample alone, so the rewards are the same whatever the order of arrival.

        scoring = scorer.batch(n)
        scoring.submit(i, sample)                         # for every i in range(n), as sample i is final
        rewards, failures, scored_before = scoring.result()
    """

    def __init__(self, scorer: Scorer, n: int):
        self.scorer = scorer
        self.samples: list[Sample | None] = [None] * n
        self.chunk_size = scorer.pool.chunk_size(n) if scorer.pool is not None else n
        self.waiting: list[int] = []  # indices handed in and not sent yet
        self.failed: dict[int, str] = {}  # index -> why its reward failed outside the terms (`fail`)
        self.sent: list[tuple[list[int], object]] = []  # (indices, task reference) of each chunk on the pool

    def submit(self, i: int, sample: Sample) -> None:
        if self.samples[i] is not None:
            raise ValueError(f"sample {i} of the batch was handed in twice")
        if (mark := inject.reward_mark()) is not None:
            sample = dataclasses.replace(sample, fault_mark=mark)
        self.samples[i] = sample
        self.waiting.append(i)
        if self.scorer.pool is not None and len(self.waiting) == self.chunk_size:
            self.send()

    def withdraw(self, i: int) -> None:
        """Sample `i` is no longer final (the engine call that made it failed): it must be handed in again.
        A chunk that already left with it still comes back; the later hand-in's outcome is the one kept."""
        self.samples[i] = None
        if i in self.waiting:
            self.waiting.remove(i)
        self.failed.pop(i, None)

    def fail(self, i: int, why: str) -> None:
        """Sample `i`'s reward failed outside the recipe's terms (its environment's, `why` naming it): it
        scores 0 and counts as one failure under the same policy, whatever its terms give."""
        self.failed[i] = why

    def send(self) -> None:
        self.sent.append((self.waiting, self.scorer.pool.submit([self.samples[i] for i in self.waiting])))
        self.waiting = []

    def result(self) -> tuple[list[float], int, int]:
        """Rewards [n] (failed samples at 0), the number that failed, and the number whose outcome was
        already back when this was called (0 in this process): how much of scoring was hidden."""
        missing = [i for i, sample in enumerate(self.samples) if sample is None]
        if missing:
            raise ValueError(f"{len(missing)} of {len(self.samples)} samples were never handed in, "
                             f"the first is {missing[0]}")
        samples: list[Sample] = self.samples
        pool = self.scorer.pool
        if pool is None or not samples:
            outcomes, scored_before = score_samples(self.scorer.terms, samples, timeout_s=self.scorer.cfg.timeout_s), 0
        else:
            if self.waiting:
                self.send()
            chunks, scored_before = pool.collect([ref for _, ref in self.sent], [len(ix) for ix, _ in self.sent])
            outcomes: list[Outcome] = [(math.nan, "")] * len(samples)
            for (indices, _), chunk in zip(self.sent, chunks):  # in the order sent: a withdrawn sample's later one wins
                for i, outcome in zip(indices, chunk):
                    outcomes[i] = outcome
        for i, why in self.failed.items():
            if outcomes[i][1] is None:  # a sample whose terms failed too keeps their reason, and counts once
                outcomes[i] = (math.nan, why)
        rewards, failures, self.scorer.first_failure = settle(outcomes, samples)
        return rewards, failures, scored_before
