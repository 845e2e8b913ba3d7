"""The RL loop: one step is generate -> reward -> old/ref logprobs -> advantages -> train -> push weights.

Everything that depends on the recipe is resolved when `RLRun` is built; `rl_step` reads like the
algorithm, one line per phase, in the order the hardware sees them. Every rank runs the same code
(SPMD under torchrun); the rollout engine lives on the first rank of each model-parallel group, which
shares the generated batch with the other ranks of its group.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from megarl.algo.advantages import (AdaptiveKLController, FixedKLController, broadcast_to_tokens,
                                     dynamic_sampling_keep, gae, grpo_advantages, kl_penalized_token_rewards,
                                     reinforce_pp_advantages,
                                     reinforce_pp_baseline_advantages, rloo_advantages, whiten)
from megarl.algo.aggregate import LossNorm, aggregate, global_loss_norm, group_sums, masked_mean, masked_sum
from megarl.algo.kl import kl_estimate
from megarl.algo.losses import gspo_loss, ppo_clip_loss, value_loss
from megarl.batch import RolloutBatch, pack_sequences
from megarl.checkpoint import save_hf
from megarl.config import AlgoConfig, Config, RecipeError, TrainConfig, dump_config
from megarl.data.prompts import PromptRow, PromptSampler, load_prompts
from megarl.data.supervised import completion_example
from megarl.engine.megatron import ParallelGroups, TrainEngine
from megarl.envs.environment import Environment, SingleTurn, environment_factory
from megarl.envs.tool_format import ObservationFormat
from megarl.handoff import push_weights
from megarl.loops.launch import init_groups
from megarl.loops.resume import already_finished, find_resume, resume_run, save_run_checkpoint
from megarl.loops.supervised import supervised_step
from megarl.metrics import MetricsWriter, PhaseTimer, check_finite
from megarl.packing import redistribute, sequence_lengths
from megarl.rewards.scorer import Sample, Scorer, Scoring, build_terms
from megarl.rollout.multi_turn import FINISH_REASONS, Trajectory, run_trajectories

log = logging.getLogger(__name__)

# (batch with rewards, old/ref logprobs and values, kl_coef) -> (advantages [B, T], returns [B, T] or None)
AdvantageFn = Callable[[RolloutBatch, float], tuple[Tensor, Tensor | None]]


@dataclass
class RLRun:
    """Everything one RL run holds, built once from the recipe."""

    cfg: Config
    groups: ParallelGroups
    tokenizer: object
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow]
    sampler: PromptSampler
    actor: TrainEngine
    reference: TrainEngine | None     # when algo.kl_coef > 0
    critic: TrainEngine | None        # when algo.name is ppo
    rollout: object | None            # the engine, on the first rank of the model-parallel group only
    prompts_per_rank: int
    advantages: AdvantageFn
    kl: FixedKLController | AdaptiveKLController
    scorer: Scorer                    # the recipe's per-sample reward terms, in process or on Ray workers
    reward_models: list[tuple[float, TrainEngine]]  # (weight, frozen scalar-head model) of reward_model terms
    weight_version: int = 0
    new_env: Callable[[], Environment] = SingleTurn  # one trajectory's environment (env.name)
    tool_schemas: list[dict] = dataclasses.field(default_factory=list)  # the environment's tools, for the prompt
    observations: ObservationFormat | None = None  # renders tool messages; None when the env sends none

    @property
    def is_rollout_rank(self) -> bool:
        return self.rollout is not None

    def trainer_engines(self) -> list[TrainEngine]:
        return [e for e in (self.actor, self.reference, self.critic) if e is not None]


# ---- one step -----------------------------------------------------------------------------------------
def rl_step(run: RLRun, step: int) -> dict[str, float]:
    cfg, timer = run.cfg, PhaseTimer()
    batch, sampling = rollout(run, timer)  # generate and score, timed as "generate" and "reward"
    with timer("release_rollout"):
        on_rollout_rank(run, "release_memory")
    with timer("wake_trainer"):
        for engine in run.trainer_engines():
            engine.onload()
    with timer("logprobs"):
        batch = compute_logprobs(run, batch)
    with timer("advantages"):
        advantages, returns = run.advantages(batch, run.kl.value)
        batch = batch.replace(advantages=advantages, returns=returns)
    with timer("balance"):  # after advantages: a group's baseline needs all its samples on one rank
        batch, tokens_imbalance = redistribute(batch, group=run.groups.dp, pad_id=run.tokenizer.pad_token_id)
    with timer("train"):
        train_metrics = train_policy(run, batch, step=step)
        train_metrics |= train_critic(run, batch) if run.critic is not None else {}
    with timer("sleep_trainer"):
        for engine in (run.actor, run.critic):
            if engine is not None:
                engine.offload_training_state()
    with timer("push"):
        push_stats = push_policy(run)
    with timer("wake_rollout"):
        for engine in run.trainer_engines():
            engine.offload_params()
        on_rollout_rank(run, "resume_cache")
    with timer("eval"):
        eval_metrics = evaluate(run) if run.eval_rows and step % cfg.data.eval_every == 0 else {}
    metrics = batch_metrics(run, batch)
    kl_metrics = update_kl_coef(run, batch)
    seconds = sum(timer.seconds.values())
    return {
        **metrics, **sampling, **kl_metrics, **train_metrics, **eval_metrics, **timer.metrics(),
        "train/tokens_imbalance": tokens_imbalance,
        "handoff/bytes": float(push_stats["bytes"]),
        "throughput/tokens_per_s": global_sum(run, float(batch.prompt_lens.sum() + batch.response_mask.sum()))
        / seconds,
    }


# ---- phases -------------------------------------------------------------------------------------------
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
            failures, hidden, n = global_sums(run, [float(failures), float(hidden), float(len(batch))])
            return batch, {"reward/failures": failures, "timing/reward_hidden_frac": hidden / n}
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
    failures, rounds, n_kept, n_seen, filled, reward_sum, hidden = global_sums(
        run, [float(failures), float(rounds), float(n_kept), float(n_seen), float(filled), reward_sum, float(hidden)])
    return full.select(torch.arange(want)), {
        "reward/failures": failures,
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


def compute_logprobs(run: RLRun, batch: RolloutBatch) -> RolloutBatch:
    """Old (actor), reference and critic outputs [B, T] on the response tokens, before any update."""
    micro = micro_batching(run.cfg.train, batch)
    kwargs = dict(temperature=run.cfg.rollout.temperature, **micro)
    mask = batch.response_mask
    old = run.actor.logprobs(batch.tokens, **kwargs) * mask
    ref = run.reference.logprobs(batch.tokens, **kwargs) * mask if run.reference else None
    values = run.critic.values(batch.tokens, **micro) * mask if run.critic else None
    return batch.replace(old_logprobs=old, ref_logprobs=ref, values=values)


def policy_loss(logprobs: Tensor, mb: dict[str, Tensor], *, algo: AlgoConfig, norm: LossNorm,
                entropy: Tensor | None = None) -> tuple[Tensor, dict]:
    """The policy loss of one micro-batch, as a contribution to the global-batch loss: the clipped
    surrogate (PPO-clip, or GSPO's sequence ratio), plus the KL to the reference as a loss term when
    `ref_logprobs` is given, minus the entropy bonus when `entropy` [b, T] is given. Statistics are
    token means over the global batch."""
    mask = mb["response_mask"]
    token_mean = partial(aggregate, mask=mask, mode="token-mean", norm=norm)
    if algo.name == "gspo":
        per_token, stats = gspo_loss(logprobs, mb["old_logprobs"], masked_mean(mb["advantages"], mask, dim=-1),
                                     mask, clip_low=algo.clip_low, clip_high=algo.clip_high)
    else:
        per_token, stats = ppo_clip_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask,
                                         clip_low=algo.clip_low, clip_high=algo.clip_high,
                                         dual_clip=algo.dual_clip, rollout_logprobs=mb.get("rollout_logprobs"),
                                         tis_cap=algo.tis_cap)
    loss = aggregate(per_token, mask, mode=algo.loss_agg, norm=norm)
    out = {"pg_loss": loss.detach(), "clipfrac": token_mean(stats["clipped"]),
           "ppo_kl": token_mean(stats["approx_kl"])}
    if "tis_weight" in stats:
        out["tis_weight_mean"] = token_mean(stats["tis_weight"])
    if "ref_logprobs" in mb:
        kl = token_mean(kl_estimate(logprobs, mb["ref_logprobs"], kind=algo.kl_estimator))
        loss = loss + algo.kl_coef * kl
        out["kl"] = kl.detach()
    if entropy is not None:
        mean_entropy = token_mean(entropy)
        loss = loss - algo.entropy_coef * mean_entropy
        out["entropy"] = mean_entropy.detach()
    out["loss"] = loss.detach()
    return loss, out


def train_policy(run: RLRun, batch: RolloutBatch, *, step: int) -> dict[str, float]:
    cfg, algo = run.cfg, run.cfg.algo
    norm = dataclasses.replace(global_loss_norm(batch.response_mask, group=run.groups.dp),
                               max_len=cfg.rollout.max_new_tokens)
    extras = {"response_mask": batch.response_mask, "old_logprobs": batch.old_logprobs,
              "advantages": batch.advantages}
    if batch.ref_logprobs is not None and not algo.kl_in_reward:
        extras["ref_logprobs"] = batch.ref_logprobs
    if algo.tis_cap is not None:
        extras["rollout_logprobs"] = batch.rollout_logprobs
    run.actor.set_lr(learning_rate(cfg.optim, run.actor.step))
    metrics: dict[str, float] = {}
    for _ in range(algo.epochs):
        metrics = run.actor.train_step(batch.tokens, extras, partial(policy_loss, algo=algo, norm=norm),
                                       temperature=cfg.rollout.temperature, entropy=algo.entropy_coef > 0,
                                       **micro_batching(cfg.train, batch))
    check_finite(metrics, step=step, what="policy", keep=partial(keep_batch, run, batch, step=step))
    return metrics


def critic_loss(values: Tensor, mb: dict[str, Tensor], *, value_clip: float | None, norm: LossNorm
                ) -> tuple[Tensor, dict]:
    """Clipped value loss of one micro-batch, token mean over the global batch. The statistics include the
    token means of R, R^2, R - V and (R - V)^2, from which `train_critic` forms the explained variance."""
    mask = mb["response_mask"]
    per_token, stats = value_loss(values, mb["values"], mb["returns"], mask, clip=value_clip)
    token_mean = partial(aggregate, mask=mask, mode="token-mean", norm=norm)
    loss = token_mean(per_token)
    error = mb["returns"] - values.detach()
    return loss, {"critic/loss": loss.detach(), "critic/clipfrac": token_mean(stats["vf_clipped"]),
                  "critic/values_mean": token_mean(values.detach()),
                  "returns_mean": token_mean(mb["returns"]), "returns_sq_mean": token_mean(mb["returns"].square()),
                  "error_mean": token_mean(error), "error_sq_mean": token_mean(error.square())}


def train_critic(run: RLRun, batch: RolloutBatch) -> dict[str, float]:
    """Fit the critic to the GAE returns, `algo.epochs` passes like the policy.

    critic/explained_var = 1 - Var(R - V) / Var(R) over the response tokens of the global batch, with the
    values of the last pass before its update: 0 for a constant critic, 1 for a perfect one.
    """
    cfg = run.cfg
    norm = global_loss_norm(batch.response_mask, group=run.groups.dp)
    extras = {"response_mask": batch.response_mask, "values": batch.values, "returns": batch.returns}
    run.critic.set_lr(learning_rate(dataclasses.replace(cfg.optim, lr=cfg.critic.lr), run.critic.step))
    metrics: dict[str, float] = {}
    for _ in range(cfg.algo.epochs):
        metrics = run.critic.train_step(batch.tokens, extras,
                                        partial(critic_loss, value_clip=cfg.critic.value_clip, norm=norm),
                                        temperature=1.0, **micro_batching(cfg.train, batch))
    returns_var = metrics.pop("returns_sq_mean") - metrics.pop("returns_mean") ** 2
    error_var = metrics.pop("error_sq_mean") - metrics.pop("error_mean") ** 2
    metrics["explained_var"] = 1.0 - error_var / returns_var if returns_var > 0 else 0.0
    metrics = {k if k.startswith("critic/") else f"critic/{k}": v for k, v in metrics.items()}
    check_finite({"loss": metrics["critic/loss"], "grad_norm": metrics["critic/grad_norm"]},
                 step=run.critic.step, what="critic", keep=partial(keep_batch, run, batch, step=run.critic.step))
    return metrics


def keep_batch(run: RLRun, batch: RolloutBatch, *, step: int) -> str:
    """Save the step's rollout batch (each rank its share), so a non-finite step can be replayed alone."""
    path = Path(run.cfg.run_dir) / f"bad_batch_step{step}_rank{dist.get_rank()}.pt"
    batch.save(path)
    return f"the batch is saved to {path} to replay it"


def push_policy(run: RLRun) -> dict:
    """Hand the updated weights to the rollout engine (every rank of the pipeline joins the gathers)."""
    run.weight_version += 1
    tensors = run.actor.pipeline_hf_tensors()
    if run.is_rollout_rank:
        run.rollout.resume_weights()
        return push_weights(run.rollout, tensors, bucket_bytes=run.cfg.rollout.bucket_bytes,
                            version=run.weight_version)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)  # drive the collectives
    return {"bytes": nbytes}


def evaluate(run: RLRun) -> dict[str, float]:
    """Mean reward on the fixed held-out prompts (this rank's share), one sample each, as in training."""
    rows = run.eval_rows[run.groups.dp_rank:: run.groups.dp_size]
    scoring = start_scoring(run, len(rows))
    batch, _, _ = score(run, generate(run, rows, n_samples=1, scoring=scoring), scoring)
    total, calls, n = global_sums(run, [float(batch.rewards.sum()), float(batch.tool_calls.sum()),
                                        float(len(batch))])
    return {"eval/reward_mean": total / n, "eval/tool_calls_mean": calls / n}


def batch_metrics(run: RLRun, batch: RolloutBatch) -> dict[str, float]:
    """Reward, length, rollout-vs-trainer logprob drift and the environment's turns, tool calls and finish
    reasons over the global batch (one all-reduce). Response lengths count generated tokens only."""
    mask = batch.response_mask.bool()
    diff = (batch.rollout_logprobs - batch.old_logprobs).abs()[mask]
    n, tokens, rewards, truncated, diff_sum, turns, calls, *ended = global_sums(run, [
        float(len(batch)), float(mask.sum()), float(batch.rewards.sum()),
        float(sum(r == "length" for r in batch.finish_reasons)), float(diff.sum()),
        float(batch.turns.sum()), float(batch.tool_calls.sum()),
        *(float(sum(r == reason for r in batch.finish_reasons)) for reason in FINISH_REASONS)])
    diff_max = torch.tensor([float(diff.max()) if diff.numel() else 0.0])
    if run.groups.dp_size > 1:
        dist.all_reduce(diff_max, op=dist.ReduceOp.MAX, group=run.groups.dp)
    return {
        "reward/mean": rewards / n,
        "response/len_mean": tokens / n,
        "response/truncated_frac": truncated / n,
        "rollout/logprob_diff_mean": diff_sum / max(tokens, 1.0),
        "rollout/logprob_diff_max": float(diff_max),
        "env/turns_mean": turns / n,
        "env/tool_calls_mean": calls / n,
        **{f"env/ended_by/{reason}": count / n for reason, count in zip(FINISH_REASONS, ended)},
    }


def update_kl_coef(run: RLRun, batch: RolloutBatch) -> dict[str, float]:
    """Step the KL controller with this batch's KL per sequence (summed over tokens, mean over the global
    batch, Ziegler et al. 2019) when the KL is part of the reward."""
    if run.reference is None or not run.cfg.algo.kl_in_reward:
        return {}
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kind=run.cfg.algo.kl_estimator)
    kl_sum, n = global_sums(run, [float(masked_sum(kl, batch.response_mask)), float(len(batch))])
    coef = run.kl.value
    run.kl.update(kl_sum / n, int(n))
    return {"kl/seq_mean": kl_sum / n, "kl/coef": coef}


# ---- helpers ----------------------------------------------------------------------------------------
def micro_batching(train: TrainConfig, batch: RolloutBatch) -> dict:
    """The engines' micro-batch arguments: `train.micro_batch_size` padded sequences, or packed rows of at
    most `train.micro_batch_tokens` tokens (which need each sample's length)."""
    if not train.micro_batch_tokens:
        return {"micro_batch_size": train.micro_batch_size}
    return {"micro_batch_size": train.micro_batch_size, "micro_batch_tokens": train.micro_batch_tokens,
            "lengths": sequence_lengths(batch.response_mask, batch.prompt_lens)}


def on_rollout_rank(run: RLRun, method: str) -> None:
    """Call a memory method of the rollout engine on the rank that holds it."""
    if run.is_rollout_rank:
        getattr(run.rollout, method)()


def encode_prompt(tokenizer, prompt: str, *, chat_template: bool, tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids, wrapped as a user turn in the tokenizer's chat template when asked, which also
    lists `tools` (JSON schemas) the way the template does.

    The template is rendered to text and then tokenized, because `apply_chat_template(tokenize=True)`
    returns a list in some transformers releases and a BatchEncoding in others.
    """
    if chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tools=tools or None,
                                               add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def global_sum(run: RLRun, value: float) -> float:
    return global_sums(run, [value])[0]


def global_sums(run: RLRun, values: list[float]) -> list[float]:
    """Sums over the data-parallel ranks of the run, in one all-reduce."""
    return group_sums(values, group=run.groups.dp)


def learning_rate(optim, step: int) -> float:
    """Linear warmup over `optim.warmup_steps` optimizer steps, then constant."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    return optim.lr


def advantage_fn(algo: AlgoConfig, *, group) -> AdvantageFn:
    """The recipe's advantage estimator, as (batch, kl_coef) -> (advantages [B, T], returns [B, T] or None).

    Sequence rewards are the recipe's reward terms. PPO and REINFORCE++ work on per-token rewards, where a
    KL penalty in the reward (algo.kl_in_reward) is added; `group` is the DP group over which token
    advantages are whitened.
    """
    def rewards(batch: RolloutBatch) -> Tensor:
        return batch.rewards

    def token_rewards(batch: RolloutBatch, kl_coef: float) -> Tensor:
        kl = torch.zeros_like(batch.old_logprobs)
        if algo.kl_in_reward and batch.ref_logprobs is not None:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kind=algo.kl_estimator)
        return kl_penalized_token_rewards(rewards(batch), kl, batch.response_mask, kl_coef=kl_coef)

    def per_sequence(estimator) -> AdvantageFn:
        return lambda batch, kl_coef: (
            broadcast_to_tokens(estimator(rewards(batch), batch.group_ids), batch.response_mask), None)

    match algo.name:
        case "ppo":
            def ppo(batch: RolloutBatch, kl_coef: float) -> tuple[Tensor, Tensor]:
                adv, returns = gae(token_rewards(batch, kl_coef), batch.values, batch.response_mask,
                                   gamma=algo.gamma, lam=algo.lam)
                return whiten(adv, batch.response_mask, group=group), returns
            return ppo
        case "grpo" | "dapo" | "gspo":
            return per_sequence(partial(grpo_advantages, std_norm=algo.std_norm))
        case "dr_grpo":
            return per_sequence(partial(grpo_advantages, std_norm=False))
        case "rloo":
            return per_sequence(rloo_advantages)
        case "reinforce_pp":
            return lambda batch, kl_coef: (reinforce_pp_advantages(token_rewards(batch, kl_coef),
                                                                   batch.response_mask, gamma=algo.gamma,
                                                                   group=group), None)
        case "reinforce_pp_baseline":
            return lambda batch, kl_coef: (reinforce_pp_baseline_advantages(rewards(batch), batch.group_ids,
                                                                            batch.response_mask, group=group),
                                           None)
    raise RecipeError(f"algo.name: unknown estimator {algo.name!r}")


def kl_controller(algo: AlgoConfig) -> FixedKLController | AdaptiveKLController:
    if algo.kl_target is not None:
        return AdaptiveKLController(algo.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon)
    return FixedKLController(algo.kl_coef)


def observation_format(cfg: Config, tokenizer) -> ObservationFormat | None:
    """How tool messages are rendered for the recipe's environment; None for single_turn, which sends none."""
    if cfg.env.kind == "single_turn":
        return None
    try:
        return ObservationFormat(tokenizer)
    except Exception as e:  # noqa: BLE001 - the template's own errors (jinja) name what it could not render
        raise RecipeError(f"env.name: {cfg.env.name} sends tool messages, but the chat template of model.path "
                          f"cannot render them: {type(e).__name__}: {e}") from None


def make_rollout_engine(cfg: Config, model_dir: str, *, dp_rank: int):
    """The recipe's rollout engine, seeded per data-parallel replica (not per global rank, so a run resumed
    at another TP/PP layout samples as the one that saved it)."""
    seed = cfg.seed + dp_rank
    match cfg.rollout.engine:
        case "native":
            from megarl.rollout.native import NativeEngine

            return NativeEngine(model_dir, dtype=cfg.model.dtype, seed=seed)
        case "sglang":
            from megarl.rollout.sglang_engine import SGLangEngine

            return SGLangEngine(model_dir, dtype=cfg.model.dtype, seed=seed,
                                tp_size=cfg.rollout.tp, mem_fraction=cfg.rollout.mem_fraction,
                                base_gpu_id=torch.cuda.current_device() if torch.cuda.is_available() else 0)
    raise ValueError(f"rollout.engine: unknown engine {cfg.rollout.engine!r}")


# ---- supervised warm start -----------------------------------------------------------------------------
def sft_warmup(cfg: Config, groups: ParallelGroups, tokenizer, rows: list[PromptRow]) -> str:
    """Supervised steps on the train set's answers; returns the HF directory RL starts from.

    Each example is the prompt as RL encodes it, then the answer and EOS, as a rollout should end. The
    result is exported to RUN_DIR/warmup, so the actor, the reference and the rollout engine all start
    from the same weights, and a rerun reuses it instead of training again.
    """
    out = Path(cfg.run_dir) / "warmup"
    if (out / "megarl_checkpoint.json").exists():
        log.info("reusing supervised warm start in %s", out)
        return str(out)
    optim = dataclasses.replace(cfg.optim, lr=cfg.warmup.lr, warmup_steps=0)
    engine = TrainEngine(model_dir=cfg.model.path, dtype=cfg.model.dtype, megatron=cfg.model.megatron,
                         groups=groups, optim=optim)
    sampler = PromptSampler(len(rows), seed=cfg.seed + 1, dp_rank=groups.dp_rank, dp_size=groups.dp_size)
    per_rank = cfg.warmup.batch_size // groups.dp_size
    bar = tqdm(total=cfg.warmup.sft_steps, desc="sft warm start", dynamic_ncols=True,
               disable=not (cfg.log.progress and dist.get_rank() == 0))
    for step in range(cfg.warmup.sft_steps):
        examples = [completion_example(encode_prompt(tokenizer, r.prompt, chat_template=cfg.data.chat_template),
                                       tokenizer(r.answer, add_special_tokens=False)["input_ids"]
                                       + [tokenizer.eos_token_id])
                    for r in (rows[i] for i in sampler.next_batch(per_rank))]
        metrics = supervised_step(engine, examples, pad_id=tokenizer.pad_token_id, group=groups.dp,
                                  micro_batch_size=math.gcd(per_rank, cfg.train.micro_batch_size))
        bar.set_postfix({"nll": f"{metrics['loss']:.3f}", "answer_prob": f"{metrics['response_prob']:.3f}"},
                        refresh=False)
        bar.update(1)
        if metrics["response_prob"] >= cfg.warmup.stop_answer_prob:
            break
    bar.close()
    log.info("supervised warm start: %d steps, answer probability %.3f", step + 1, metrics["response_prob"])
    export_policy(engine, groups, source_dir=cfg.model.path, out_dir=out,
                  meta={"stage": "sft_warmup", "steps": step + 1, "answer_prob": metrics["response_prob"]})
    return str(out)


def export_policy(engine: TrainEngine, groups: ParallelGroups, *, source_dir: str, out_dir: Path,
                  meta: dict) -> None:
    """Write the model as an HF checkpoint from global rank 0; its model-parallel peers join the gathers
    (with expert parallelism that is every rank: the expert-parallel peers sit in other data-parallel ranks)."""
    engine.onload()  # on GPU the parameters wait on the host from the weight push to the next step
    if groups.dp_rank == 0 or groups.ep_size > 1:
        tensors = engine.pipeline_hf_tensors()
        if dist.get_rank() == 0:
            save_hf(tensors, source_dir=source_dir, out_dir=out_dir, meta=meta)
        else:
            for _ in tensors:
                pass
    dist.barrier()


# ---- the run ---------------------------------------------------------------------------------------------
def check_launch(cfg: Config, groups: ParallelGroups) -> None:
    """Batch sizes against this launch's data-parallel size, and the reward terms and environment import;
    RecipeError names the keys."""
    build_terms(cfg.reward)  # a custom reward that does not import stops here, before any work
    environment_factory(cfg.env)  # and so does an environment
    dp = groups.dp_size
    if cfg.data.prompts_per_step % dp:
        raise RecipeError(f"data.prompts_per_step={cfg.data.prompts_per_step} is not divisible by the "
                          f"data-parallel size {dp} (world size / (parallel.tp * parallel.pp * parallel.cp))")
    samples = cfg.data.prompts_per_step // dp * cfg.rollout.n_samples
    if samples % cfg.train.micro_batch_size and not cfg.train.micro_batch_tokens:
        raise RecipeError(f"samples per data-parallel rank {samples} (data.prompts_per_step / {dp} * "
                          f"rollout.n_samples) is not divisible by train.micro_batch_size={cfg.train.micro_batch_size}")
    if cfg.warmup.sft_steps and cfg.warmup.batch_size % dp:
        raise RecipeError(f"warmup.batch_size={cfg.warmup.batch_size} is not divisible by the data-parallel size {dp}")


def build_run(cfg: Config, groups: ParallelGroups, *, tokenizer, train_rows: list[PromptRow],
              eval_rows: list[PromptRow], model_dir: str) -> RLRun:
    actor = TrainEngine(model_dir=model_dir, dtype=cfg.model.dtype, megatron=cfg.model.megatron, groups=groups,
                        optim=cfg.optim)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = TrainEngine(model_dir=model_dir, dtype=cfg.model.dtype, megatron=cfg.model.megatron,
                                groups=groups)
    critic = None
    if cfg.algo.name == "ppo":
        critic = TrainEngine(model_dir=cfg.critic.path or model_dir, dtype=cfg.model.dtype,
                             megatron=cfg.model.megatron, groups=groups,
                             optim=dataclasses.replace(cfg.optim, lr=cfg.critic.lr), value_head=True)
    # Reward models stay on the device the whole step (their scores are needed as generation ends).
    reward_models = [(term.weight, TrainEngine(model_dir=term.path, dtype=cfg.model.dtype,
                                               megatron=cfg.model.megatron, groups=groups, value_head=True))
                     for term in cfg.reward.terms if term.kind == "reward_model"]
    is_rollout_rank = dist.get_rank() == groups.mp_src_global_rank
    rollout = make_rollout_engine(cfg, model_dir, dp_rank=groups.dp_rank) if is_rollout_rank else None
    sampler = PromptSampler(len(train_rows), seed=cfg.seed, shuffle=cfg.data.shuffle, dp_rank=groups.dp_rank,
                            dp_size=groups.dp_size)
    new_env = environment_factory(cfg.env)
    return RLRun(cfg=cfg, groups=groups, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
                 sampler=sampler, actor=actor, reference=reference, critic=critic, rollout=rollout,
                 prompts_per_rank=cfg.data.prompts_per_step // groups.dp_size,
                 advantages=advantage_fn(cfg.algo, group=groups.dp),
                 kl=kl_controller(cfg.algo), scorer=Scorer(cfg.reward), reward_models=reward_models,
                 new_env=new_env,
                 tool_schemas=new_env().tools, observations=observation_format(cfg, tokenizer))


def train(cfg: Config) -> Path:
    """Run the recipe; returns the directory of the final checkpoint."""
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run_dir)
    groups = init_groups(cfg)
    check_launch(cfg, groups)
    final = run_dir / "checkpoints" / "final"
    resume_from, done = find_resume(cfg)
    if already_finished(cfg, resume_from, done, cfg.train.steps):
        return final
    data = cfg.data
    fields = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, metadata_key=data.metadata_key,
                  skip_bad_rows=data.skip_bad_rows)
    train_rows = load_prompts(data.train_path, **fields)
    eval_rows = load_prompts(data.eval_path, **fields)[: data.eval_prompts] if data.eval_path else []
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model_dir = sft_warmup(cfg, groups, tokenizer, train_rows) if cfg.warmup.sft_steps else cfg.model.path
    run = build_run(cfg, groups, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
                    model_dir=model_dir)
    start = resume_run(run, resume_from) if resume_from is not None else 0
    if dist.get_rank() == 0:
        dump_config(cfg, run_dir / "recipe.yaml")
    writer = MetricsWriter(run_dir, total_steps=cfg.train.steps, enabled=dist.get_rank() == 0,
                           progress=cfg.log.progress, tensorboard=cfg.log.tensorboard, resume_step=start)
    try:
        push_policy(run)  # the trainer's own weights, which also proves the name table
        for step in range(start + 1, cfg.train.steps + 1):
            metrics = rl_step(run, step)
            if step % cfg.log.every_steps == 0 or step == cfg.train.steps:
                writer.write(step, metrics)
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < cfg.train.steps:
                save_run_checkpoint(run, step)
        if cfg.checkpoint.save_final:
            save_run_checkpoint(run, cfg.train.steps)
            export_policy(run.actor, run.groups, source_dir=cfg.model.path, out_dir=final,
                          meta={"step": cfg.train.steps})
    finally:
        writer.close()
        run.scorer.close()
        if run.rollout is not None:
            run.rollout.shutdown()
    return final
