"""The rollout phase of an RL step: sample trajectories on the rollout engines and score them.

`rollout` draws this replica's prompts (more rounds with dynamic sampling), `generate` runs the
environment's trajectories on the engines of this rank's exchange group (megarl.rollout.placement: every
device generates, whatever the trainer's layout) and hands every rank its replica's batch, `score` adds the
recipe's rewards. `evaluate` does the same on the held-out prompts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megarl.algo.advantages import dynamic_sampling_keep
from megarl.batch import RolloutBatch, pack_sequences
from megarl.data.prompts import PromptRow, encode_prompt
from megarl.engine.megatron import TrainEngine
from megarl.loops.rl_run import RLRun
from megarl.metrics import PhaseTimer
from megarl.packing import balanced_partition
from megarl.rewards.scorer import Scoring
from megarl.rewards.terms import Sample
from megarl.rollout.multi_turn import Trajectory, run_trajectories
from megarl.rollout.placement import RolloutPlacement

log = logging.getLogger(__name__)


def rollout(run: RLRun, timer: PhaseTimer, source: Rounds | None = None) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate and score this rank's share of the step's prompts, in rounds that `source` runs (placement
    split: on the rollout ranks, megarl.loops.split; by default on this rank's exchange group's engines).

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
    source = source or ColocatedRounds(run)
    kept: list[RolloutBatch] = []
    dropped: list[RolloutBatch] = []
    failures, n_kept, n_seen, rounds, reward_sum, hidden, engines = 0, 0, 0, 0, 0.0, 0, 0
    done = False
    while True:
        # A replica that has its groups still takes part in its exchange group's rounds, drawing nothing
        # (its engine may generate for another replica).
        if not done:
            rounds += 1
        batch, round_failures, round_hidden, round_engines = source.next(0 if done else run.prompts_per_rank, timer)
        failures += round_failures
        hidden += round_hidden
        engines = max(engines, round_engines)
        if not cfg.algo.uses_dynamic_sampling:
            failures, hidden, engines, n = run.global_sums([float(failures), float(hidden), float(engines),
                                                            float(len(batch))])
            return batch, {"reward/failures": failures, "reward/failed_frac": failures / n,
                           "timing/reward_hidden_frac": hidden / n, "rollout/engines": engines}
        if batch is not None:
            # group ids restart at 0 in every round; shift them so groups stay distinct across rounds
            batch = dataclasses.replace(batch, group_ids=batch.group_ids + n_seen)
            n_seen += run.prompts_per_rank
            reward_sum += float(batch.rewards.sum())
            keep = dynamic_sampling_keep(batch.rewards, batch.group_ids)
            kept.append(batch.select(keep.nonzero().squeeze(1)))
            dropped.append(batch.select((~keep).nonzero().squeeze(1)))
            n_kept += int(keep.sum()) // cfg.rollout.n_samples
        done = n_kept >= run.prompts_per_rank or rounds == cfg.algo.max_sampling_rounds
        if not source.anyone(not done):
            break
    want = run.prompts_per_rank * cfg.rollout.n_samples
    full = RolloutBatch.concat(kept + dropped, pad_id=run.tokenizer.pad_token_id)
    filled = max(0, run.prompts_per_rank - n_kept)
    if filled:
        log.warning("dynamic sampling: %d of %d groups on this rank still have equal rewards after %d rounds; "
                    "they fill the batch and add no policy gradient", filled, run.prompts_per_rank, rounds)
    failures, rounds, n_kept, n_seen, filled, reward_sum, hidden, engines = run.global_sums(
        [float(failures), float(rounds), float(n_kept), float(n_seen), float(filled), reward_sum, float(hidden),
         float(engines)])
    return full.select(torch.arange(want)), {
        "reward/failures": failures,
        "reward/failed_frac": failures / (n_seen * cfg.rollout.n_samples),
        "timing/reward_hidden_frac": hidden / (n_seen * cfg.rollout.n_samples),
        "rollout/engines": engines,
        "sampling/rounds": rounds / run.groups.dp_size,
        "sampling/kept_group_frac": n_kept / n_seen,
        "sampling/filled_groups": filled,
        # the policy's reward before filtering; reward/mean is over the kept groups only
        "sampling/reward_mean": reward_sum / (n_seen * cfg.rollout.n_samples),
    }


class Rounds(Protocol):
    """Where the rounds of a step's rollout come from."""

    def next(self, draw: int, timer: PhaseTimer) -> tuple[RolloutBatch | None, int, int, int]:
        """A round of `draw` prompts of this replica (0: it takes part drawing nothing): its scored batch
        (None when it drew nothing), failed rewards, rewards scored while generating, engines that generated
        (as `score` counts them)."""
        ...

    def anyone(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank that takes part in the rounds (they draw in lockstep)."""
        ...


class ColocatedRounds:
    """Rounds on the engines of this rank's exchange group (megarl.rollout.placement)."""

    def __init__(self, run: RLRun):
        self.run = run

    def next(self, draw: int, timer: PhaseTimer) -> tuple[RolloutBatch | None, int, int, int]:
        run = self.run
        with timer("generate"):
            rows = [run.train_rows[i] for i in run.sampler.next_batch(draw)] if draw else []
            generated = generate(run, rows, n_samples=run.cfg.rollout.n_samples)
        with timer("reward"):
            return score(run, generated)

    def anyone(self, flag: bool) -> bool:
        place = self.run.placement
        if place.exchange is None:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=place.exchange)
        return bool(value)


@dataclass
class Generated:
    """One round of generation as this rank sees it: its replica's batch, and what its engine (when it hosts
    one) must still score."""

    batch: RolloutBatch | None        # this replica's samples in order; None when it drew no prompt this round
    scoring: Scoring | None           # the rewards of this engine's samples, on a rank that hosts an engine
    part: list[int]                   # exchange-wide indices of the samples this rank's engine generated
    replica: list[int]                # exchange-wide indices of this replica's samples, in batch order
    reporter: bool                    # this replica reports its exchange group's counts (the group's first)


def generate(run: RLRun, rows: list[PromptRow], *, n_samples: int) -> Generated:
    """Sample `n_samples` trajectories for each row, each with its own environment (megarl.rollout.multi_turn;
    with the single_turn environment, one response per sample), on the engines of this rank's exchange
    group (megarl.rollout.placement): the group's replicas pool their prompts, the samples are split over
    the engines by prompt tokens, and every rank receives its replica's batch. Each response the rewards
    score (a sample's last turn) goes to its engine's scorer as soon as it is final, while the engine
    generates the others."""
    cfg, place = run.cfg.rollout, run.placement
    encoded = encode_rows(run, rows)
    # every replica of the exchange group, in data-parallel order (its ranks all hold the same rows)
    shares = {dp: (their_rows, their_ids)
              for dp, their_rows, their_ids in _exchange(place, (run.groups.dp_rank, rows, encoded))}
    samples = pooled_samples(shares, n_samples=n_samples)
    parts = balanced_partition([len(ids) for _, _, ids in samples], len(place.exchange_engines))
    part = parts[place.exchange_engines.index(dist.get_rank())] if place.hosts_engine else []
    scoring, mine = None, None
    if place.hosts_engine:
        generated, scoring = generate_part(run, [samples[i][1:] for i in part])
        mine = (part, generated)
    trajectories: dict[int, Trajectory] = {}
    for done in _exchange(place, mine):
        if done is not None:
            trajectories.update(zip(*done))
    replica = [i for i, (dp, _, _) in enumerate(samples) if dp == run.groups.dp_rank]
    batch = build_batch(run, [samples[i][1] for i in replica], [samples[i][2] for i in replica],
                   [trajectories[i] for i in replica], n_samples=n_samples) if replica else None
    return Generated(batch=batch, scoring=scoring, part=part, replica=replica,
                     reporter=run.groups.dp_rank == min(shares))


def encode_rows(run: RLRun, rows: list[PromptRow]) -> list[list[int]]:
    """The prompt ids of `rows` as the engines take them (the recipe's chat template, the environment's tools)."""
    return [encode_prompt(run.tokenizer, row.prompt, chat_template=run.cfg.data.chat_template, tools=run.tool_schemas)
            for row in rows]


def pooled_samples(shares: dict[int, tuple[list[PromptRow], list[list[int]]]], *,
                   n_samples: int) -> list[tuple[int, PromptRow, list[int]]]:
    """(replica, row, prompt ids) of every sample of the replicas' `shares` (rows and their prompt ids by
    data-parallel rank), replica by replica, `n_samples` in a row for each prompt."""
    return [(dp, row, ids) for dp in sorted(shares) for row, ids in zip(*shares[dp]) for _ in range(n_samples)]


def generate_part(run, samples: list[tuple[PromptRow, list[int]]]) -> tuple[list[Trajectory], Scoring]:
    """Run the trajectories of `samples` (row, prompt ids) on this rank's engine (`run.rollout`), handing each
    response to a new scoring of `run.scorer` as soon as it is final. `run` is an RLRun, or a rollout rank's
    own view of one (megarl.loops.split) with the same fields."""
    cfg = run.cfg.rollout
    scoring = run.scorer.batch(len(samples))

    def last_turn(i: int, trajectory: Trajectory) -> None:
        row, _ = samples[i]
        scoring.submit(i, Sample(row.prompt, response_text(run.tokenizer, trajectory), row.answer, row.metadata,
                                 response_tokens=sum(trajectory.generated_mask)))

    trajectories = run_trajectories(
        run.rollout, [ids for _, ids in samples], [run.new_env() for _ in samples],
        [(row.prompt, row.metadata) for row, _ in samples], tokenizer=run.tokenizer, observations=run.observations,
        limits=run.cfg.env, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
        on_last_turn=last_turn, workers=run.env_workers)
    return trajectories, scoring


def build_batch(run: RLRun, rows: list[PromptRow], prompts: list[list[int]], trajectories: list[Trajectory], *,
           n_samples: int) -> RolloutBatch:
    tokens, mask, rollout_logprobs = pack_sequences(prompts, [t.response_ids for t in trajectories],
                                                    [t.logprobs for t in trajectories],
                                                    pad_id=run.tokenizer.pad_token_id,
                                                    generated_masks=[t.generated_mask for t in trajectories])
    return RolloutBatch(
        tokens=tokens, response_mask=mask, rollout_logprobs=rollout_logprobs,
        prompt_lens=torch.tensor([len(p) for p in prompts]),
        group_ids=torch.arange(len(rows) // n_samples).repeat_interleave(n_samples),
        responses=[response_text(run.tokenizer, t) for t in trajectories],
        answers=[row.answer for row in rows],
        finish_reasons=[t.finish_reason for t in trajectories],
        prompt_texts=[row.prompt for row in rows],
        metadata=[row.metadata for row in rows],
        turns=torch.tensor([t.turns for t in trajectories]),
        tool_calls=torch.tensor([t.tool_calls for t in trajectories]),
        env_rewards=torch.tensor([t.env_reward for t in trajectories]),
        routes=_routes(prompts, trajectories),
    )


def _routes(prompts: list[list[int]], trajectories: list[Trajectory]) -> list[Tensor] | None:
    """Each sample's engine routes over its tokens but the last (a turn cut to its token budget leaves rows
    past the sample's end, which are dropped); None when the engines captured none."""
    if any(t.routes is None for t in trajectories):
        return None
    return [t.routes[: len(p) + len(t.response_ids) - 1] for p, t in zip(prompts, trajectories)]


def _exchange(place: RolloutPlacement, item) -> list:
    """`item` of every rank of the exchange group, in rank order."""
    if place.exchange is None:
        return [item]
    out = [None] * len(place.exchange_ranks)
    dist.all_gather_object(out, item, group=place.exchange)
    return out


def response_text(tokenizer, trajectory: Trajectory) -> str:
    """What the reward terms score: the model's last turn, decoded (once: the scorer reads it as soon as
    the turn is final, the batch keeps it)."""
    if trajectory.last_turn_text is None:
        trajectory.last_turn_text = tokenizer.decode(trajectory.last_turn, skip_special_tokens=True)
    return trajectory.last_turn_text


def score(run: RLRun, generated: Generated) -> tuple[RolloutBatch | None, int, int, int]:
    """The replica's batch with the recipe's rewards [B], plus the environment's and the reward models'; and
    the number of samples whose reward failed (scored 0; see Scorer), the number already scored when
    generation ended, and the number of engines that generated, over the exchange group, on the replica
    that reports them (0 on the group's other replicas, so sums over data-parallel ranks count each once).

    Each engine's rank scores the samples its engine generated (a sandbox or a Ray pool runs once per
    sample, not once per rank) and the exchange group shares the rewards. Reward-model terms need the
    trainer's ranks, so they are scored here, after generation, over `batch.tokens`.
    """
    result = (generated.part, *generated.scoring.result()) if generated.scoring is not None else None
    rewards_of: dict[int, float] = {}
    counts = torch.zeros(3, dtype=torch.float64)  # failures, scored before generation ended, engines
    for item in _exchange(run.placement, result):
        if item is not None:
            part, rewards, _, _ = item
            rewards_of.update(zip(part, rewards))
    if result is not None:
        counts += torch.tensor([result[2], result[3], int(bool(generated.part))], dtype=torch.float64)
    if run.placement.exchange is not None:  # every sample was scored by exactly one engine's rank
        dist.all_reduce(counts, group=run.placement.exchange)
    failures, hidden, engines = (int(c) * generated.reporter for c in counts.tolist())
    batch = generated.batch
    if batch is None:
        return None, failures, hidden, engines
    rewards = torch.tensor([rewards_of[i] for i in generated.replica])
    return with_rewards(run, batch, rewards), failures, hidden, engines


def with_rewards(run: RLRun, batch: RolloutBatch, rewards: Tensor) -> RolloutBatch:
    """The batch with its rewards: the recipe's per-sample terms (`rewards`, scored where the samples were
    generated) plus the reward models' (scored here: every rank of the model-parallel group takes part) and
    the environment's."""
    micro_batch_size = math.gcd(len(batch), run.cfg.train.micro_batch_size)
    for weight, model in run.reward_models:
        rewards = rewards + weight * reward_model_scores(model, batch, pad_id=run.tokenizer.pad_token_id,
                                                         micro_batch_size=micro_batch_size)
    if batch.env_rewards is not None:
        rewards = rewards + batch.env_rewards
    return batch.replace(rewards=rewards)


def reward_model_scores(model: TrainEngine, batch: RolloutBatch, *, pad_id: int, micro_batch_size: int) -> Tensor:
    """[B] a reward model's scalar on each sequence: its head on the hidden state of the last response
    token (the prompt's last when the response is empty), where HF's sequence classifiers read it.

    The engine's values put head(h[t - 1]) in column t, so one padding column is appended and column
    last + 1 is read; the padding comes after the sequence and cannot change it (causal attention).
    """
    values = model.values(F.pad(batch.tokens, (0, 1), value=pad_id), micro_batch_size=micro_batch_size)
    positions = torch.arange(batch.tokens.shape[1])
    last = torch.where(batch.response_mask.bool(), positions, batch.prompt_lens[:, None] - 1).max(dim=1).values
    return values.gather(1, (last + 1)[:, None]).squeeze(1)


def evaluate(run: RLRun) -> dict[str, float]:
    """Mean reward on the fixed held-out prompts (this rank's share), one sample each, as in training."""
    rows = run.eval_rows[run.groups.dp_rank:: run.groups.dp_size]
    if run.split is not None:
        batch = run.split.generate_now(run, rows, n_samples=1)
    else:
        batch, _, _, _ = score(run, generate(run, rows, n_samples=1))
    mine = [float(batch.rewards.sum()), float(batch.tool_calls.sum()), float(len(batch))] if batch else [0.0] * 3
    total, calls, n = run.global_sums(mine)
    return {"eval/reward_mean": total / n, "eval/tool_calls_mean": calls / n}
