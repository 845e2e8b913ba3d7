"""The RL loop: one step is generate -> reward -> old/ref logprobs -> advantages -> train -> push weights.

Everything that depends on the recipe is resolved when the run is built (megarl.loops.rl_run); `rl_step`
reads like the algorithm, one line per phase, in the order the hardware sees them. Every training rank runs
the same code (SPMD under torchrun). Where the samples come from and where the weights go is the run's
`Rollouts`, chosen once by the placement (`train`): engines on the trainer's own devices
(megarl.loops.colocated) or on rollout ranks of their own (megarl.loops.split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megarl import inject
from megarl.algo.aggregate import LossNorm, global_loss_norm, masked_sum
from megarl.algo.kl import kl_estimate, reverse_kl
from megarl.batch import RolloutBatch
from megarl.config import Config, SandboxConfig, TrainConfig
from megarl.data.prompts import load_prompts
from megarl.envs.trajectories import FINISH_REASONS
from megarl.loops.colocated import ColocatedRollouts
from megarl.loops.faults import EngineLost, check_versions
from megarl.loops.launch import resolve_job, start_parallel
from megarl.loops.lifecycle import final_dir, run_steps
from megarl.loops.resume import RunState, already_finished, checkpoint_due, find_resume, save_checkpoint
from megarl.loops.rl_run import RLRun, Rollouts, build_run
from megarl.loops.split import SplitRollouts, is_rollout_rank
from megarl.loops.split_worker import serve_rollout
from megarl.loops.warmup import sft_warmup
from megarl.metrics import PhaseTimer, check_finite
from megarl.objective import explained_variance
from megarl.packing import (PromptGroups, equal_part, nonzero_advantage, redistribute, sequence_lengths,
                            zero_advantage_split)
from megarl.rewards.code import check_test_specs
from megarl.rewards.scorer import RewardFailure
from megarl.routing import compact


# ---- one step -----------------------------------------------------------------------------------------
def rl_step(run: RLRun, step: int, *, save: Callable[[int], object] | None = None) -> dict[str, float]:
    """One update; `save(step)` writes the step's checkpoint when one is due (`checkpoint_due`), after the update
    and before the weights go to the engines (a colocated run: the trainer's state is still on the device, so
    no hand-over of its own follows the checkpoint)."""
    cfg, timer = run.cfg, PhaseTimer()
    inject.enter_step(step)
    inject.at("generate")
    batch, sampling = run.rollouts.next_batch(run, step, timer)  # timed as "generate" and "reward"
    check_versions(batch, run.rollouts.versions(run, step), step=step, group=run.groups.dp)
    check_rewards(run, sampling["reward/failed_frac"], step=step)
    with timer("release_rollout"):
        run.rollouts.release()
    with timer("wake_trainer"):
        for engine in run.trainer_engines():
            engine.onload()
    with timer("logprobs"):
        batch = compute_logprobs(run, batch)
    moe = routing_metrics(run)  # the old-logprob forward's; on-policy, the training forward is the first
    with timer("advantages"):
        advantages, returns = run.advantages(batch, run.kl.value)
        batch = batch.replace(advantages=inject.poison(advantages), returns=returns)
    with timer("balance"):  # after advantages: a group's baseline needs all its samples on one rank
        # the whole batch's counts: samples the trainer skips stay in the loss's denominators
        norm = global_loss_norm(batch.response_mask, group=run.groups.dp)
        trained, trained_frac, stats_norm, untrained = batch, 1.0, None, None
        if skips_zero_advantage(run):
            # pipeline stages exchange padded micro-batches of micro_batch_size rows only
            rows = cfg.train.micro_batch_size if run.groups.pp_size > 1 and not cfg.train.micro_batch_tokens else 1
            trained, trained_frac = zero_advantage_split(batch, group=run.groups.dp, multiple=rows)
            if trained_frac < 1.0:  # the statistics are means over the samples trained (trained_frac is global)
                stats_norm = global_loss_norm(trained.response_mask, group=run.groups.dp)
                if run.objective.on_policy:
                    untrained = untrained_logprobs(run, batch, multiple=rows)
        trained, tokens_imbalance = redistribute(trained, group=run.groups.dp, pad_id=run.tokenizer.pad_token_id)
    inject.at("train")
    with timer("train"):
        train_metrics, trained = train_policy(run, trained, norm=norm, stats_norm=stats_norm, step=step)
        train_metrics |= train_critic(run, trained) if run.critic is not None else {}
    run.count_device("train", activations=run.ledger.activations(activation_tokens(cfg.train, trained))
                     if run.ledger is not None else 0)
    run.weight_version += 1
    training_moe = routing_metrics(run)  # also clears the counts of the training passes
    moe = moe or training_moe
    metrics = batch_metrics(run, batch, trained, untrained) | distill_metrics(run, batch)
    run.drift.observe(metrics["rollout/logprob_diff_mean"], tokens=metrics["rollout/logprob_diff_tokens"], step=step)
    kl_metrics = update_kl_coef(run, batch)
    if save is not None and checkpoint_due(cfg, step, cfg.train.steps):
        save(step)  # the step is complete and the trainer's state is still on the device
    inject.at("push")
    try:
        push_stats = run.rollouts.hand_over(run, timer)
        with timer("eval"):
            eval_metrics = evaluate(run) if run.eval_rows and step % cfg.data.eval_every == 0 else {}
    except EngineLost as e:  # the step has updated the trainer: the run saves it
        e.trained = True
        raise
    metrics |= run.rollouts.metrics(run)
    run.check_device()
    if run.ledger is not None:
        metrics |= run.ledger.metrics()
    seconds = sum(timer.seconds.values())
    tokens, = run.global_sums([float(batch.prompt_lens.sum() + batch.response_mask.sum())])
    return {
        **metrics, **sampling, **kl_metrics, **train_metrics, **eval_metrics, **moe, **timer.metrics(),
        "train/tokens_imbalance": tokens_imbalance, "train/trained_frac": trained_frac,
        "handoff/bytes": float(push_stats["bytes"]), "handoff/verified_tensors": float(push_stats["verified"]),
        "handover/offloaded_bytes": float(push_stats["offloaded_bytes"]),
        **({"async/push_wait_s": push_stats["wait_s"]} if "wait_s" in push_stats else {}),
        "throughput/tokens_per_s": tokens / seconds,
        "data/rows": run.sampler.take_drawn(),
    }


# ---- phases -------------------------------------------------------------------------------------------
def compute_logprobs(run: RLRun, batch: RolloutBatch) -> RolloutBatch:
    """Old (actor), reference, teacher and critic outputs [B, T] on the response tokens, before any update. An
    on-policy update takes the actor's from its training forward instead (`train_policy`); distillation is
    never on-policy (AlgoConfig.distills: its advantages need the student's logprobs). The teacher scores at
    the sampling temperature, as the student does, so both are the distributions of the same temperature."""
    micro = micro_batching(run.cfg.train, batch)
    kwargs = dict(temperature=run.cfg.rollout.temperature, **micro)
    mask = batch.response_mask
    old, recorded = None, None
    if not run.objective.on_policy:
        routes = run.routes.old_logprobs(batch.routes)
        old = run.actor.logprobs(batch.tokens, routes=routes, **kwargs) * mask
        if routes.record:
            lengths = sequence_lengths(batch.response_mask, batch.prompt_lens).tolist()
            recorded = [compact(r[:n], run.actor.shape.experts) for r, n in zip(run.actor.recorded_routes(), lengths)]
    ref = run.reference.logprobs(batch.tokens, **kwargs) * mask if run.reference else None
    teacher = run.teacher.logprobs(batch.tokens, **kwargs) * mask if run.teacher else None
    values = run.critic.values(batch.tokens, **micro) * mask if run.critic else None
    return batch.replace(old_logprobs=old, ref_logprobs=ref, teacher_logprobs=teacher, values=values,
                         trainer_routes=recorded)


def train_policy(run: RLRun, batch: RolloutBatch, *, norm: LossNorm, stats_norm: LossNorm | None,
                 step: int) -> tuple[dict[str, float], RolloutBatch]:
    """`algo.epochs` optimizer steps of the actor on the batch, with the objective built from the recipe.
    `norm`: the counts of the whole global batch, of which `batch` may be the part with a non-zero advantage
    (`zero_advantage_split`), whose counts are then `stats_norm`, so the statistics are means over the
    samples trained. Returns the last step's metrics and the batch, which holds the old logprobs afterwards:
    an on-policy update's come from its one training forward."""
    cfg, objective = run.cfg, run.objective
    # Dr. GRPO's constant divisor is the generation budget, not the longest response of this batch
    loss_fn = partial(objective, norm=dataclasses.replace(norm, max_len=cfg.rollout.max_new_tokens),
                      stats_norm=stats_norm)
    kwargs = dict(temperature=cfg.rollout.temperature, entropy=objective.needs_entropy,
                  routes=run.routes.training(batch.routes, batch.trainer_routes), **micro_batching(cfg.train, batch))
    if objective.on_policy:  # one epoch (AlgoConfig.on_policy)
        metrics, logprobs = run.actor.train_step(batch.tokens, objective.inputs(batch), loss_fn,
                                                 return_outputs=True, **kwargs)
        batch = batch.replace(old_logprobs=logprobs * batch.response_mask)
    else:
        for _ in range(cfg.algo.epochs):
            metrics = run.actor.train_step(batch.tokens, objective.inputs(batch), loss_fn, **kwargs)
    check_finite(metrics, step=step, what="policy", keep=partial(keep_batch, run, batch, step=step))
    return metrics, batch


def train_critic(run: RLRun, batch: RolloutBatch) -> dict[str, float]:
    """Fit the critic to the GAE returns, `algo.epochs` passes like the policy; critic/explained_var uses
    the values of the last pass before its update."""
    cfg, objective = run.cfg, run.critic_objective
    loss_fn = partial(objective, norm=global_loss_norm(batch.response_mask, group=run.groups.dp))
    metrics: dict[str, float] = {}
    for _ in range(cfg.algo.epochs):
        metrics = run.critic.train_step(batch.tokens, objective.inputs(batch), loss_fn, temperature=1.0,
                                        **micro_batching(cfg.train, batch))
    metrics = explained_variance(metrics)
    check_finite({"loss": metrics["critic/loss"], "grad_norm": metrics["critic/grad_norm"]},
                 step=run.critic.step, what="critic", keep=partial(keep_batch, run, batch, step=run.critic.step))
    return metrics


def untrained_logprobs(run: RLRun, batch: RolloutBatch, *, multiple: int) -> RolloutBatch:
    """The samples an on-policy update skips (a zero advantage, `zero_advantage_split`), as many on every
    data-parallel rank (`equal_part`), with the trainer's logprobs of their tokens as old_logprobs: an
    on-policy update computes logprobs in its training forward alone, and the drift (rollout/logprob_diff)
    covers every sample, so engines generating from the wrong weights stop the run even when nothing trains.
    A forward pass over those samples."""
    part, _ = equal_part(batch, ~nonzero_advantage(batch), group=run.groups.dp, multiple=multiple)
    routes = run.routes.training(part.routes, None)
    logprobs = run.actor.logprobs(part.tokens, temperature=run.cfg.rollout.temperature,
                                  routes=routes if routes.replay else None, **micro_batching(run.cfg.train, part))
    return part.replace(old_logprobs=logprobs * part.response_mask)


def activation_tokens(train: TrainConfig, batch: RolloutBatch) -> int:
    """What sizes the largest micro-batch a training pass of `batch` runs, as the plan's activation formula takes
    it (megarl.plan.estimate.training_activations): the batch's padded width (micro_batch_size sequences of it),
    or with packing the tokens of its fullest packed row (at most train.micro_batch_tokens)."""
    if train.micro_batch_tokens:
        lengths = sequence_lengths(batch.response_mask, batch.prompt_lens)
        return min(train.micro_batch_tokens, int(lengths.sum()))
    return int(batch.tokens.shape[1])


def skips_zero_advantage(run: RLRun) -> bool:
    """Whether the policy trains on the samples with a non-zero advantage only (`train.skip_zero_advantage`):
    when a zero-advantage sample adds nothing to the policy loss and a critic does not train on it too."""
    return run.cfg.train.skip_zero_advantage and run.objective.inert_at_zero_advantage and run.critic is None


def check_rewards(run: RLRun, failed_frac: float, *, step: int) -> None:
    """Count the consecutive steps in which every sample's reward failed (`failed_frac` over the global
    batch, so every rank decides alike) and raise RewardFailure at `reward.max_failed_steps` of them."""
    run.failed_reward_steps = run.failed_reward_steps + 1 if failed_frac == 1.0 else 0
    limit = run.cfg.reward.max_failed_steps
    if limit and run.failed_reward_steps >= limit:
        raise RewardFailure(f"every reward failed in {limit} consecutive steps (up to step {step}; "
                            f"reward.max_failed_steps={limit}); the first failure of this rank's last batch: "
                            f"{run.scorer.first_failure}")


def keep_batch(run: RLRun, batch: RolloutBatch, *, step: int) -> str:
    """Save the step's rollout batch (each rank its share), so a non-finite step can be replayed alone."""
    path = Path(run.cfg.run_dir) / f"bad_batch_step{step}_rank{dist.get_rank()}.pt"
    batch.save(path)
    return f"the batch is saved to {path} to replay it"


def evaluate(run: RLRun) -> dict[str, float]:
    """Mean reward on the fixed held-out prompts (this rank's share), one sample each, as in training."""
    batch = run.rollouts.generate_now(run, run.eval_rows[run.groups.dp_rank:: run.groups.dp_size])
    mine = [float(batch.rewards.sum()), float(batch.tool_calls.sum()), float(len(batch))] if batch else [0.0] * 3
    total, calls, n = run.global_sums(mine)
    return {"eval/reward_mean": total / n, "eval/tool_calls_mean": calls / n}


def batch_metrics(run: RLRun, batch: RolloutBatch, trained: RolloutBatch,
                  untrained: RolloutBatch | None = None) -> dict[str, float]:
    """Reward, length, rollout-vs-trainer logprob drift and the environment's turns, tool calls and finish
    reasons over the global batch (one all-reduce). Response lengths count generated tokens only. The drift
    is over every sample (`rollout/logprob_diff_tokens` counts their tokens): `batch`'s old logprobs where an
    old-logprob forward ran, else those of the training forward (`trained`, the samples with a non-zero
    advantage of `zero_advantage_split`) and of `untrained` (the others, `untrained_logprobs`)."""
    mask = batch.response_mask.bool()
    measured = [batch] if batch.old_logprobs is not None else [b for b in (trained, untrained) if b is not None]
    diff = torch.cat([(b.rollout_logprobs - b.old_logprobs).abs()[b.response_mask.bool()] for b in measured])
    n, tokens, rewards, truncated, diff_sum, diff_tokens, turns, calls, retries, *ended = run.global_sums([
        float(len(batch)), float(mask.sum()), float(batch.rewards.sum()),
        float(sum(r == "length" for r in batch.finish_reasons)), float(diff.sum()), float(diff.numel()),
        float(batch.turns.sum()), float(batch.tool_calls.sum()), float(batch.env_retries.sum()),
        *(float(sum(r == reason for r in batch.finish_reasons)) for reason in FINISH_REASONS)])
    diff_max = torch.tensor([float(diff.max()) if diff.numel() else 0.0])
    if run.groups.dp_size > 1:
        dist.all_reduce(diff_max, op=dist.ReduceOp.MAX, group=run.groups.dp)
    return {
        "reward/mean": rewards / n,
        "response/len_mean": tokens / n,
        "response/truncated_frac": truncated / n,
        "rollout/logprob_diff_mean": diff_sum / max(diff_tokens, 1.0),
        "rollout/logprob_diff_max": float(diff_max),
        "rollout/logprob_diff_tokens": diff_tokens,
        "env/turns_mean": turns / n,
        "env/tool_calls_mean": calls / n,
        "env/retries": retries,
        **{f"env/ended_by/{reason}": count / n for reason, count in zip(FINISH_REASONS, ended)},
    }


def distill_metrics(run: RLRun, batch: RolloutBatch) -> dict[str, float]:
    """distill/reverse_kl (log p_student - log p_teacher, the student's before the update) and
    distill/teacher_logprob: token means over the response tokens of the global batch; none without a teacher."""
    if batch.teacher_logprobs is None:
        return {}
    mask = batch.response_mask
    kl_sum, teacher_sum, tokens = run.global_sums([
        float(reverse_kl(batch.old_logprobs, batch.teacher_logprobs, mask).sum()),
        float((batch.teacher_logprobs * mask).sum()), float(mask.sum())])
    tokens = max(tokens, 1.0)
    return {"distill/reverse_kl": kl_sum / tokens, "distill/teacher_logprob": teacher_sum / tokens}


def update_kl_coef(run: RLRun, batch: RolloutBatch) -> dict[str, float]:
    """Step the KL controller with this batch's KL per sequence (summed over tokens, mean over the global
    batch, Ziegler et al. 2019) when the KL is part of the reward."""
    if run.reference is None or not run.cfg.algo.kl_in_reward:
        return {}
    kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kind=run.cfg.algo.kl_estimator,
                     mask=batch.response_mask)
    kl_sum, n = run.global_sums([float(masked_sum(kl, batch.response_mask)), float(len(batch))])
    coef = run.kl.value
    run.kl.update(kl_sum / n, int(n))
    return {"kl/seq_mean": kl_sum / n, "kl/coef": coef}


def routing_metrics(run: RLRun) -> dict[str, float]:
    """`moe/routing_agreement` of the actor's passes since the last call (MoE models; every rank calls)."""
    agreement = run.actor.routing_agreement()
    return {} if agreement is None else {"moe/routing_agreement": agreement}


# ---- helpers ----------------------------------------------------------------------------------------
def micro_batching(train: TrainConfig, batch: RolloutBatch) -> dict:
    """The engines' micro-batch arguments: `train.micro_batch_size` padded sequences, or packed rows of at
    most `train.micro_batch_tokens` tokens (which need each sample's length), with `train.share_prompts` a
    group's prompt once in its row."""
    if not train.micro_batch_tokens:
        return {"micro_batch_size": train.micro_batch_size}
    shared = {"prompt_groups": PromptGroups(batch.group_ids, batch.prompt_lens)} if train.share_prompts else {}
    return {"micro_batch_size": train.micro_batch_size, "micro_batch_tokens": train.micro_batch_tokens,
            "lengths": sequence_lengths(batch.response_mask, batch.prompt_lens), **shared}


# ---- the run ---------------------------------------------------------------------------------------------
def train(cfg: Config) -> Path:
    """Run the recipe; returns the directory of the final checkpoint."""
    from transformers import AutoTokenizer

    job = resolve_job(cfg)
    match cfg.placement.mode:
        case "colocated":
            make_rollouts: type[Rollouts] = ColocatedRollouts
        case "split":
            if is_rollout_rank(job):
                serve_rollout(job)  # until the training ranks are done
                return final_dir(cfg)
            make_rollouts = SplitRollouts
    groups = start_parallel(job)  # placement split: the training ranks meet as a world of their own
    inject.arm(cfg.faults, rank=dist.get_rank(), run_dir=cfg.run_dir)
    resume_from, done = find_resume(cfg)
    if already_finished(cfg, resume_from, done, cfg.train.steps):
        make_rollouts(job, groups).close()  # placement split: the rollout ranks wait for a command
        return final_dir(cfg)
    data = cfg.data
    fields = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, metadata_key=data.metadata_key,
                  skip_bad_rows=data.skip_bad_rows)
    train_rows = load_prompts(data.train_path, **fields)
    eval_rows = load_prompts(data.eval_path, **fields)[: data.eval_prompts] if data.eval_path else []
    code_terms = [term for term in cfg.reward.terms if term.kind == "code"]
    if code_terms:
        output_bytes = min((term.sandbox or SandboxConfig()).output_bytes for term in code_terms)
        check_test_specs(train_rows, where=data.train_path, output_bytes=output_bytes)
        check_test_specs(eval_rows, where=data.eval_path, output_bytes=output_bytes)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    if job.warm_start is not None:
        job = job.from_warm_start(sft_warmup(job, groups, tokenizer, train_rows))
    run = build_run(job, groups, rollouts=make_rollouts(job, groups), tokenizer=tokenizer, train_rows=train_rows,
                    eval_rows=eval_rows)
    try:
        # the first push hands over the trainer's own (or restored) weights, which also proves the name table
        state = run_state(run)
        save = partial(save_checkpoint, cfg, state=state, held=True) if state.saves_in_step else None
        return run_steps(cfg, state, step=partial(rl_step, run, save=save), steps=cfg.train.steps,
                         resume_from=resume_from, desc="rl", on_start=lambda: run.rollouts.hand_over(run, PhaseTimer()))
    finally:
        run.rollouts.close()
        run.scorer.close()
        if run.env_workers is not None:
            run.env_workers.retire()


def run_state(run: RLRun) -> RunState:
    """What a checkpoint of the run holds: the trained models, the sampler, the weight version and the KL
    controller, and the rollouts' own state and files."""
    rollouts = run.rollouts

    def load_extra(saved: dict) -> None:
        run.kl.load_state_dict(saved["kl"])
        run.weight_version = saved["weight_version"]

    return RunState(groups=run.groups, engines=run.trained_engines(), sampler=run.sampler,
                    rollout_engines=rollouts.engines, resident=partial(rollouts.resident, run),
                    saves_in_step=isinstance(rollouts, ColocatedRollouts),
                    count_device=run.count_device,
                    check_device=run.check_device,
                    extra=lambda: {"weight_version": run.weight_version, "kl": run.kl.state_dict(), **rollouts.state()},
                    load_extra=load_extra, save_files=rollouts.save, load_files=rollouts.restore)
