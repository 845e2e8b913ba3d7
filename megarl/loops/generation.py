"""The rollout phase of an RL step: sample trajectories on the rollout engine and score them.

`rollout` draws this rank's prompts (more rounds with dynamic sampling), `generate` runs the environment's
trajectories on the group's rollout engine and shares the batch with the group's other ranks, `score` adds
the recipe's rewards. `evaluate` does the same on the held-out prompts.
"""

from __future__ import annotations

import dataclasses
import logging
import math

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
from megarl.rewards.scorer import Scoring
from megarl.rewards.terms import Sample
from megarl.rollout.multi_turn import Trajectory, run_trajectories

log = logging.getLogger(__name__)


def rollout(run: RLRun, timer: PhaseTimer) -> tuple[RolloutBatch, dict[str, float]]:
    """Generate and score this rank's share of the step's prompts.

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
    kept: list[RolloutBatch] = []
    dropped: list[RolloutBatch] = []
    failures, n_kept, n_seen, rounds, reward_sum, hidden = 0, 0, 0, 0, 0.0, 0
    while True:
        rounds += 1
        with timer("generate"):
            rows = [run.train_rows[i] for i in run.sampler.next_batch(run.prompts_per_rank)]
            scoring = start_scoring(run, len(rows) * cfg.rollout.n_samples)
            batch = generate(run, rows, n_samples=cfg.rollout.n_samples, scoring=scoring)
        with timer("reward"):
            batch, round_failures, round_hidden = score(run, batch, scoring)
        failures += round_failures
        hidden += round_hidden
        if not cfg.algo.uses_dynamic_sampling:
            failures, hidden, n = run.global_sums([float(failures), float(hidden), float(len(batch))])
            return batch, {"reward/failures": failures, "reward/failed_frac": failures / n,
                           "timing/reward_hidden_frac": hidden / n}
        # group ids restart at 0 in every round; shift them so groups stay distinct across rounds
        batch = dataclasses.replace(batch, group_ids=batch.group_ids + n_seen)
        n_seen += run.prompts_per_rank
        reward_sum += float(batch.rewards.sum())
        keep = dynamic_sampling_keep(batch.rewards, batch.group_ids)
        kept.append(batch.select(keep.nonzero().squeeze(1)))
        dropped.append(batch.select((~keep).nonzero().squeeze(1)))
        n_kept += int(keep.sum()) // cfg.rollout.n_samples
        if n_kept >= run.prompts_per_rank or rounds == cfg.algo.max_sampling_rounds:
            break
    want = run.prompts_per_rank * cfg.rollout.n_samples
    full = RolloutBatch.concat(kept + dropped, pad_id=run.tokenizer.pad_token_id)
    filled = max(0, run.prompts_per_rank - n_kept)
    if filled:
        log.warning("dynamic sampling: %d of %d groups on this rank still have equal rewards after %d rounds; "
                    "they fill the batch and add no policy gradient", filled, run.prompts_per_rank, rounds)
    failures, rounds, n_kept, n_seen, filled, reward_sum, hidden = run.global_sums(
        [float(failures), float(rounds), float(n_kept), float(n_seen), float(filled), reward_sum, float(hidden)])
    return full.select(torch.arange(want)), {
        "reward/failures": failures,
        "reward/failed_frac": failures / (n_seen * cfg.rollout.n_samples),
        "timing/reward_hidden_frac": hidden / (n_seen * cfg.rollout.n_samples),
        "sampling/rounds": rounds / run.groups.dp_size,
        "sampling/kept_group_frac": n_kept / n_seen,
        "sampling/filled_groups": filled,
        # the policy's reward before filtering; reward/mean is over the kept groups only
        "sampling/reward_mean": reward_sum / (n_seen * cfg.rollout.n_samples),
    }


def start_scoring(run: RLRun, n: int) -> Scoring | None:
    """A batch of `n` samples for the scorer, on the rank that scores (see score())."""
    return run.scorer.batch(n) if run.is_rollout_rank else None


def generate(run: RLRun, rows: list[PromptRow], *, n_samples: int, scoring: Scoring | None = None) -> RolloutBatch:
    """Sample `n_samples` trajectories for each row on this group's rollout engine, each with its own
    environment (megarl.rollout.multi_turn; with the single_turn environment, one response per sample);
    all ranks get the batch. The response of a sample, which rewards score, is its model's last turn;
    each is handed to `scoring` as soon as it is final, while the engine generates the others."""
    cfg = run.cfg.rollout
    encoded = [encode_prompt(run.tokenizer, row.prompt, chat_template=run.cfg.data.chat_template,
                             tools=run.tool_schemas) for row in rows]
    prompts = [ids for ids in encoded for _ in range(n_samples)]
    samples = [row for row in rows for _ in range(n_samples)]

    def last_turn(i: int, trajectory: Trajectory) -> None:
        row = samples[i]
        scoring.submit(i, Sample(row.prompt, response_text(run.tokenizer, trajectory), row.answer, row.metadata,
                                 response_tokens=sum(trajectory.generated_mask)))

    result = [None]
    if run.is_rollout_rank:
        result = [run_trajectories(run.rollout, prompts, [run.new_env() for _ in samples],
                                   [(row.prompt, row.metadata) for row in samples], tokenizer=run.tokenizer,
                                   observations=run.observations, limits=run.cfg.env, temperature=cfg.temperature,
                                   top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                                   on_last_turn=last_turn if scoring is not None else None)]
    if dist.get_world_size(run.groups.mp) > 1:
        dist.broadcast_object_list(result, src=run.groups.mp_src_global_rank, group=run.groups.mp)
    trajectories = result[0]
    tokens, mask, rollout_logprobs = pack_sequences(prompts, [t.response_ids for t in trajectories],
                                                    [t.logprobs for t in trajectories],
                                                    pad_id=run.tokenizer.pad_token_id,
                                                    generated_masks=[t.generated_mask for t in trajectories])
    return RolloutBatch(
        tokens=tokens, response_mask=mask, rollout_logprobs=rollout_logprobs,
        prompt_lens=torch.tensor([len(p) for p in prompts]),
        group_ids=torch.arange(len(rows)).repeat_interleave(n_samples),
        responses=[response_text(run.tokenizer, t) for t in trajectories],
        answers=[row.answer for row in samples],
        finish_reasons=[t.finish_reason for t in trajectories],
        prompt_texts=[row.prompt for row in samples],
        metadata=[row.metadata for row in samples],
        turns=torch.tensor([t.turns for t in trajectories]),
        tool_calls=torch.tensor([t.tool_calls for t in trajectories]),
        env_rewards=torch.tensor([t.env_reward for t in trajectories]),
    )


def response_text(tokenizer, trajectory: Trajectory) -> str:
    """What the reward terms score: the model's last turn, decoded."""
    return tokenizer.decode(trajectory.last_turn, skip_special_tokens=True)


def score(run: RLRun, batch: RolloutBatch, scoring: Scoring | None) -> tuple[RolloutBatch, int, int]:
    """The recipe's rewards [B], plus the environment's and the reward models', the number of samples whose
    reward failed (scored 0; see Scorer), and the number already scored when generation ended.

    Every rank of a model-parallel group holds the same batch; only its first rank scores (a sandbox or a
    Ray pool must not run once per TP rank, and a reward with a timeout could differ between runs): its
    `scoring` got every sample during generate() and the others receive the result. Reward-model terms
    need the trainer's ranks, so they are scored here, after generation, over `batch.tokens`.
    """
    result = [scoring.result() if run.is_rollout_rank else None]
    if dist.get_world_size(run.groups.mp) > 1:
        dist.broadcast_object_list(result, src=run.groups.mp_src_global_rank, group=run.groups.mp)
    rewards, failures, hidden = result[0]
    rewards = torch.tensor(rewards)
    micro_batch_size = math.gcd(len(batch), run.cfg.train.micro_batch_size)
    for weight, model in run.reward_models:  # every rank of the model-parallel group takes part
        rewards = rewards + weight * reward_model_scores(model, batch, pad_id=run.tokenizer.pad_token_id,
                                                         micro_batch_size=micro_batch_size)
    if batch.env_rewards is not None:
        rewards = rewards + batch.env_rewards
    return batch.replace(rewards=rewards), failures, hidden


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
    scoring = start_scoring(run, len(rows))
    batch, _, _ = score(run, generate(run, rows, n_samples=1, scoring=scoring), scoring)
    total, calls, n = run.global_sums([float(batch.rewards.sum()), float(batch.tool_calls.sum()),
                                        float(len(batch))])
    return {"eval/reward_mean": total / n, "eval/tool_calls_mean": calls / n}
