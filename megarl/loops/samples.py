"""One sample from prompt to scored row, the same wherever it is generated: a co-located engine
(megarl.loops.colocated) or a rollout rank of placement split (megarl.loops.split).

`encode_rows` makes the engines' prompt ids, `pooled_samples` lays out a round's samples, `EnginePart`
runs an engine's share of them (each with its own environment, megarl.envs.trajectories; again on a new
engine after a failure) and hands every final response to the scorer, `build_batch` packs a replica's
trajectories into a RolloutBatch and `with_rewards` adds the rewards a training rank computes (reward models,
the environment's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from megarl.batch import RolloutBatch, pack_sequences
from megarl.config import Config
from megarl.data.prompts import PromptRow, encode_prompt
from megarl.engine.megatron import TrainEngine
from megarl.envs.environment import Environment
from megarl.envs.tool_format import ObservationFormat
from megarl.envs.trajectories import LIMITS, EnvWorkers, Trajectory, TrajectoryRun
from megarl.rewards.scorer import Scorer, Scoring
from megarl.rewards.terms import Sample
from megarl.rollout.engine import EngineError, RolloutEngine


class SampleContext(Protocol):
    """What making samples reads from the run: a training rank's RLRun, or a rollout rank's own
    (megarl.loops.split.RolloutRank)."""

    cfg: Config
    tokenizer: object
    scorer: Scorer
    new_env: Callable[[], Environment]         # one trajectory's environment (env.name)
    tool_schemas: list[dict]                  # the environment's tools, for the prompt
    observations: ObservationFormat | None    # renders tool messages; None when the env sends none
    env_workers: EnvWorkers | None            # the threads of the environment steps


def encode_rows(ctx: SampleContext, rows: list[PromptRow]) -> list[list[int]]:
    """The prompt ids of `rows` as the engines take them (the recipe's chat template, the environment's tools)."""
    return [encode_prompt(ctx.tokenizer, row.prompt, chat_template=ctx.cfg.data.chat_template,
                          tools=ctx.tool_schemas) for row in rows]


def pooled_samples(shares: dict[int, tuple[list[PromptRow], list[list[int]]]], *,
                   n_samples: int) -> list[tuple[int, PromptRow, list[int]]]:
    """(replica, row, prompt ids) of every sample of the replicas' `shares` (rows and their prompt ids by
    data-parallel rank), replica by replica, `n_samples` in a row for each prompt."""
    return [(dp, row, ids) for dp in sorted(shares) for row, ids in zip(*shares[dp]) for _ in range(n_samples)]


class EnginePart:
    """An engine's share of a round: the trajectories of `samples` (row, prompt ids), each response handed to
    a scoring of `ctx.scorer` as soon as it is final. `run` generates what is left on an engine; after a
    failed engine call (whose responses are dropped and withdrawn from the scoring) a later `run` on a new
    engine goes on from there, so no sample is lost or scored twice."""

    def __init__(self, ctx: SampleContext, samples: list[tuple[PromptRow, list[int]]]):
        cfg = ctx.cfg.rollout
        self.ctx, self.samples = ctx, samples
        self.scoring = ctx.scorer.batch(len(samples))
        self.trajectories = TrajectoryRun(
            [ids for _, ids in samples], [ctx.new_env() for _ in samples],
            [(row.prompt, row.metadata) for row, _ in samples], tokenizer=ctx.tokenizer,
            observations=ctx.observations, limits=ctx.cfg.env, temperature=cfg.temperature, top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens, on_last_turn=self.last_turn, on_retract=self.scoring.withdraw,
            new_env=ctx.new_env)

    def last_turn(self, i: int, trajectory: Trajectory) -> None:
        row, _ = self.samples[i]
        self.scoring.submit(i, Sample(row.prompt, response_text(self.ctx.tokenizer, trajectory), row.answer,
                                      row.metadata, response_tokens=sum(trajectory.generated_mask)))

    def unfinished(self) -> int:
        """The trajectories a `run` goes on with: after a failed one, those generated again on the next engine."""
        return len(self.trajectories.active)

    def run(self, engine: RolloutEngine) -> EngineError | None:
        """Generate every trajectory not finished yet on `engine`; the engine's failure, or None."""
        try:
            self.trajectories.run(engine, self.ctx.env_workers)
        except EngineError as e:
            return e
        return None

    def result(self) -> tuple[list[Trajectory], Scoring]:
        """The trajectories, in order, and their scoring. A trajectory whose environment reward failed fails
        its sample's reward, as a failing reward term would."""
        trajectories = self.trajectories.trajectories
        for i, trajectory in enumerate(trajectories):
            if trajectory.env_reward_failure is not None:
                self.scoring.fail(i, trajectory.env_reward_failure)
        return trajectories, self.scoring


def generate_part(ctx: SampleContext, engine: RolloutEngine,
                  samples: list[tuple[PromptRow, list[int]]]) -> tuple[list[Trajectory], Scoring]:
    """The trajectories of `samples` on `engine` and their scoring (EnginePart); an engine failure is raised."""
    part = EnginePart(ctx, samples)
    if (fault := part.run(engine)) is not None:
        raise fault
    return part.result()


def build_batch(tokenizer, rows: list[PromptRow], prompts: list[list[int]], trajectories: list[Trajectory], *,
                engines: list[int], n_samples: int, first_group: int = 0) -> RolloutBatch:
    """A replica's samples (`n_samples` in a row for each prompt), generated by `engines` (one index per
    sample), as a RolloutBatch without rewards, its groups numbered from `first_group` (a later round of
    dynamic sampling numbers on from the earlier ones)."""
    tokens, mask, rollout_logprobs = pack_sequences(prompts, [t.response_ids for t in trajectories],
                                                    [t.logprobs for t in trajectories],
                                                    pad_id=tokenizer.pad_token_id,
                                                    generated_masks=[t.generated_mask for t in trajectories])
    versions = torch.zeros_like(tokens)  # [B, T]
    for row, (prompt, t) in enumerate(zip(prompts, trajectories)):
        versions[row, len(prompt): len(prompt) + len(t.versions)] = torch.tensor(t.versions, dtype=torch.long)
    return RolloutBatch(
        tokens=tokens, response_mask=mask, rollout_logprobs=rollout_logprobs,
        prompt_lens=torch.tensor([len(p) for p in prompts]),
        group_ids=torch.arange(first_group, first_group + len(rows) // n_samples).repeat_interleave(n_samples),
        responses=[response_text(tokenizer, t) for t in trajectories],
        answers=[row.answer for row in rows],
        finish_reasons=[t.finish_reason for t in trajectories],
        prompt_texts=[row.prompt for row in rows],
        metadata=[row.metadata for row in rows],
        turns=torch.tensor([t.turns for t in trajectories]),
        tool_calls=torch.tensor([t.tool_calls for t in trajectories]),
        env_retries=torch.tensor([t.env_retries for t in trajectories]),
        env_rewards=torch.tensor([t.env_reward for t in trajectories]),
        routes=batch_routes(prompts, trajectories),
        weight_versions=versions * mask.long(),
        engines=torch.tensor(engines, dtype=torch.long),
    )


def batch_routes(prompts: list[list[int]], trajectories: list[Trajectory]) -> list[Tensor] | None:
    """Each sample's engine routes over its tokens but the last (a turn cut to its token budget leaves rows
    past the sample's end, which are dropped); None when the engines captured none."""
    if any(t.routes is None for t in trajectories):
        return None
    return [t.routes[: len(p) + len(t.response_ids) - 1] for p, t in zip(prompts, trajectories)]


def response_text(tokenizer, trajectory: Trajectory) -> str:
    """What the reward terms score: the model's last turn, decoded (once: the scorer reads it as soon as
    the turn is final, the batch keeps it)."""
    if trajectory.last_turn_text is None:
        trajectory.last_turn_text = tokenizer.decode(trajectory.last_turn, skip_special_tokens=True)
    return trajectory.last_turn_text


def with_rewards(batch: RolloutBatch, rewards: Tensor, *, reward_models: list[tuple[float, TrainEngine]],
                 micro_batch_size: int, pad_id: int, unfinished: float | None = None) -> RolloutBatch:
    """The batch with its rewards: the recipe's per-sample terms (`rewards`, scored where the samples were
    generated) plus the reward models' (scored here: every rank of the model-parallel group takes part) and
    the environment's; `unfinished` (`reward.unfinished`), when set, in place of that sum for every sample a
    limit cut off."""
    micro_batch_size = math.gcd(len(batch), micro_batch_size)
    for weight, model in reward_models:
        rewards = rewards + weight * reward_model_scores(model, batch, pad_id=pad_id,
                                                         micro_batch_size=micro_batch_size)
    if batch.env_rewards is not None:
        rewards = rewards + batch.env_rewards
    if unfinished is not None:
        cut_off = torch.tensor([reason in LIMITS for reason in batch.finish_reasons])
        rewards = torch.where(cut_off, torch.tensor(unfinished, dtype=rewards.dtype), rewards)
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
