"""The step's batch, drawn in rounds: one round, or with dynamic sampling (DAPO) as many as it takes to fill
the batch with groups whose rewards differ. Where a round is generated is the placement's
(megarl.loops.colocated, megarl.loops.split): both hand their rounds to `draw_batch`."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from megarl.algo.advantages import dynamic_sampling_keep
from megarl.batch import RolloutBatch
from megarl.loops.rl_run import RLRun
from megarl.metrics import PhaseTimer

log = logging.getLogger(__name__)


class Rounds(Protocol):
    """Where the rounds of a step's rollout come from."""

    def next(self, draw: int, timer: PhaseTimer, *, first_group: int) -> tuple[RolloutBatch | None, int, int, int]:
        """A round of `draw` prompts of this replica (0: it takes part drawing nothing), its groups numbered
        from `first_group`: its scored batch (None when it drew nothing), failed rewards, rewards scored while
        generating, engines that generated (counted once over the data-parallel ranks)."""
        ...

    def anyone(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank that takes part in the rounds (they draw in lockstep)."""
        ...


def draw_batch(run: RLRun, timer: PhaseTimer, rounds: Rounds) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's share of the step's prompts, generated and scored in `rounds`, and the sampling metrics.

    Each sample's reward terms are handed to the scorer as soon as its response is final; on a Ray pool
    (reward.workers > 0) they are scored while the rest of the round generates, and what is left is
    waited for in the "reward" phase. A round's rewards are complete when its generation ends, because
    dynamic sampling (DAPO, Yu et al. 2025) needs them to decide whether to draw more (so scoring overlaps
    the generation of its own round, never the next one): groups whose final rewards are all equal
    have zero advantage and no policy gradient, so they are dropped and another round of prompts is
    drawn, up to algo.max_sampling_rounds rounds. Kept groups beyond the batch are discarded. A batch
    still short after the last round is filled with dropped groups (they add no policy gradient but
    count in loss denominators) and a warning says so.
    """
    cfg = run.cfg
    if not cfg.algo.uses_dynamic_sampling:
        batch, failures, hidden, engines = rounds.next(run.prompts_per_rank, timer, first_group=0)
        failures, hidden, engines, n = run.global_sums([float(failures), float(hidden), float(engines),
                                                        float(len(batch))])
        return batch, {"reward/failures": failures, "reward/failed_frac": failures / n,
                       "timing/reward_hidden_frac": hidden / n, "rollout/engines": engines}
    kept: list[RolloutBatch] = []
    dropped: list[RolloutBatch] = []
    failures, n_kept, n_seen, drawn, reward_sum, hidden, engines = 0, 0, 0, 0, 0.0, 0, 0
    done = False
    while True:
        # A replica that has its groups still takes part in the rounds of its exchange group, drawing nothing
        # (its engine may generate for another replica).
        drawn += not done
        batch, round_failures, round_hidden, round_engines = rounds.next(
            0 if done else run.prompts_per_rank, timer, first_group=n_seen)
        failures += round_failures
        hidden += round_hidden
        engines = max(engines, round_engines)
        if batch is not None:
            n_seen += run.prompts_per_rank
            reward_sum += float(batch.rewards.sum())
            keep = dynamic_sampling_keep(batch.rewards, batch.group_ids)
            kept.append(batch.select(keep.nonzero().squeeze(1)))
            dropped.append(batch.select((~keep).nonzero().squeeze(1)))
            n_kept += int(keep.sum()) // cfg.rollout.n_samples
        done = n_kept >= run.prompts_per_rank or drawn == cfg.algo.max_sampling_rounds
        if not rounds.anyone(not done):
            break
    want = run.prompts_per_rank * cfg.rollout.n_samples
    full = RolloutBatch.concat(kept + dropped, pad_id=run.tokenizer.pad_token_id)
    filled = max(0, run.prompts_per_rank - n_kept)
    if filled:
        log.warning("dynamic sampling: %d of %d groups on this rank still have equal rewards after %d rounds; "
                    "they fill the batch and add no policy gradient", filled, run.prompts_per_rank, drawn)
    failures, drawn, n_kept, n_seen, filled, reward_sum, hidden, engines = run.global_sums(
        [float(failures), float(drawn), float(n_kept), float(n_seen), float(filled), reward_sum, float(hidden),
         float(engines)])
    return full.select(torch.arange(want)), {
        "reward/failures": failures,
        "reward/failed_frac": failures / (n_seen * cfg.rollout.n_samples),
        "timing/reward_hidden_frac": hidden / (n_seen * cfg.rollout.n_samples),
        "rollout/engines": engines,
        "sampling/rounds": drawn / run.groups.dp_size,
        "sampling/kept_group_frac": n_kept / n_seen,
        "sampling/filled_groups": filled,
        # the policy's reward before filtering; reward/mean is over the kept groups only
        "sampling/reward_mean": reward_sum / (n_seen * cfg.rollout.n_samples),
    }
