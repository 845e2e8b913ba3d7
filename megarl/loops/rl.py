"""The RL loop: one step is generate -> reward -> old/ref logprobs -> advantages -> train -> push weights.

Everything that depends on the recipe is resolved when the run is built (megarl.loops.rl_run); `rl_step`
reads like the algorithm, one line per phase, in the order the hardware sees them. Every rank runs the
same code (SPMD under torchrun); a rollout engine lives on the first rank of every group of rollout.tp
ranks, and each rank receives its data-parallel replica's batch (megarl.loops.generation).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algo.aggregate import LossNorm, global_loss_norm, masked_sum
from megarl.algo.kl import kl_estimate
from megarl.batch import RolloutBatch
from megarl.config import Config, TrainConfig
from megarl.data.prompts import load_prompts
from megarl.handoff import push_weights
from megarl.loops.generation import evaluate, rollout
from megarl.loops.launch import init_groups
from megarl.loops.lifecycle import final_dir, run_steps
from megarl.loops.resume import RunState, already_finished, find_resume
from megarl.loops.rl_run import RLRun, build_run, check_launch
from megarl.loops.split import SplitRollout, dismiss_rollout_ranks, is_rollout_rank, serve_rollout
from megarl.loops.warmup import sft_warmup
from megarl.metrics import PhaseTimer, check_finite
from megarl.objective import explained_variance
from megarl.packing import redistribute, sequence_lengths, zero_advantage_split
from megarl.rewards.code import check_test_specs
from megarl.rewards.scorer import RewardFailure
from megarl.rollout.multi_turn import FINISH_REASONS
from megarl.routing import compact


# ---- one step -----------------------------------------------------------------------------------------
def rl_step(run: RLRun, step: int) -> dict[str, float]:
    cfg, timer = run.cfg, PhaseTimer()
    # generate and score, timed as "generate" and "reward"; placement split: take the batch the rollout ranks made
    batch, sampling = run.split.next_batch(run, step, timer) if run.split else rollout(run, timer)
    check_rewards(run, sampling["reward/failed_frac"], step=step)
    with timer("release_rollout"):
        if run.rollout is not None:
            run.rollout.release_memory()
    with timer("wake_trainer"):
        for engine in run.trainer_engines():
            engine.onload()
    with timer("logprobs"):
        batch = compute_logprobs(run, batch)
    moe = routing_metrics(run)  # the old-logprob forward's; on-policy, the training forward is the first
    with timer("advantages"):
        advantages, returns = run.advantages(batch, run.kl.value)
        batch = batch.replace(advantages=advantages, returns=returns)
    with timer("balance"):  # after advantages: a group's baseline needs all its samples on one rank
        # the whole batch's counts: samples the trainer skips stay in the loss's denominators
        norm = global_loss_norm(batch.response_mask, group=run.groups.dp)
        trained, trained_frac, stats_norm = batch, 1.0, None
        if skips_zero_advantage(run):
            # pipeline stages exchange padded micro-batches of micro_batch_size rows only
            rows = cfg.train.micro_batch_size if run.groups.pp_size > 1 and not cfg.train.micro_batch_tokens else 1
            trained, trained_frac = zero_advantage_split(batch, group=run.groups.dp, multiple=rows)
            if trained_frac < 1.0:  # the statistics are means over the samples trained (trained_frac is global)
                stats_norm = global_loss_norm(trained.response_mask, group=run.groups.dp)
        trained, tokens_imbalance = redistribute(trained, group=run.groups.dp, pad_id=run.tokenizer.pad_token_id)
    with timer("train"):
        train_metrics, trained = train_policy(run, trained, norm=norm, stats_norm=stats_norm, step=step)
        train_metrics |= train_critic(run, trained) if run.critic is not None else {}
    training_moe = routing_metrics(run)  # also clears the counts of the training passes
    moe = moe or training_moe
    push_stats = hand_over(run, timer)
    with timer("eval"):
        eval_metrics = evaluate(run) if run.eval_rows and step % cfg.data.eval_every == 0 else {}
    metrics = batch_metrics(run, batch, trained)
    kl_metrics = update_kl_coef(run, batch)
    seconds = sum(timer.seconds.values())
    tokens, = run.global_sums([float(batch.prompt_lens.sum() + batch.response_mask.sum())])
    return {
        **metrics, **sampling, **kl_metrics, **train_metrics, **eval_metrics, **moe, **timer.metrics(),
        "train/tokens_imbalance": tokens_imbalance, "train/trained_frac": trained_frac,
        "handoff/bytes": float(push_stats["bytes"]),
        "handover/offloaded_bytes": float(push_stats["offloaded_bytes"]),
        **({"async/push_wait_s": push_stats["wait_s"]} if "wait_s" in push_stats else {}),
        "throughput/tokens_per_s": tokens / seconds,
    }


# ---- phases -------------------------------------------------------------------------------------------
def compute_logprobs(run: RLRun, batch: RolloutBatch) -> RolloutBatch:
    """Old (actor), reference and critic outputs [B, T] on the response tokens, before any update. An
    on-policy update takes the actor's from its training forward instead (`train_policy`)."""
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
    values = run.critic.values(batch.tokens, **micro) * mask if run.critic else None
    return batch.replace(old_logprobs=old, ref_logprobs=ref, values=values, trainer_routes=recorded)


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


def hand_over(run: RLRun, timer: PhaseTimer) -> dict:
    """Give the devices back to the rollout engines with the new weights: the trainer's gradients and
    optimizer state leave the device, the weights are pushed, the trainer's parameters leave too and the
    engines take back their KV cache. Also how a run starts (the engines released their memory while the
    trainer was built). Returns the push's counts and `offloaded_bytes`, the trainer state parked while the
    engines generate. Placement split: the push alone (the rollout ranks keep their memory; the trainer
    keeps its own)."""
    if run.split is not None:
        with timer("push"):
            return run.split.push(run) | {"offloaded_bytes": 0}
    with timer("sleep_trainer"):
        offloaded = sum(engine.offload_training_state() for engine in (run.actor, run.critic) if engine is not None)
    with timer("push"):
        push_stats = push_policy(run)
    with timer("wake_rollout"):
        offloaded += sum(engine.offload_params() for engine in run.trainer_engines())
        if run.rollout is not None:
            run.rollout.resume_cache()
    return push_stats | {"offloaded_bytes": offloaded}


@contextlib.contextmanager
def trainer_resident(run: RLRun) -> Iterator[None]:
    """The trainer's state on the device for the length of the block (a checkpoint reads it), handed back
    as after a step when it ends. The rollout engines give their memory back first, as before an update:
    the trainer never shares the device with a KV cache. Their weights are released with it, so the end
    of the block pushes them again (a new weight version, with the same weights)."""
    if run.split is not None:  # the training ranks keep their memory
        yield
        return
    if run.rollout is not None:
        run.rollout.release_memory()
    for engine in run.trainer_engines():
        engine.onload()
    yield
    hand_over(run, PhaseTimer())


def push_policy(run: RLRun) -> dict:
    """Hand the updated weights to the rollout engine (every rank of the pipeline joins the gathers)."""
    run.weight_version += 1
    tensors = run.actor.pipeline_hf_tensors()
    if run.rollout is not None:
        run.rollout.resume_weights()
        return push_weights(run.rollout, tensors, bucket_bytes=run.cfg.rollout.bucket_bytes,
                            version=run.weight_version)
    if run.rollout_peer is not None:
        return run.rollout_peer.push(tensors, bucket_bytes=run.cfg.rollout.bucket_bytes)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)  # drive the collectives
    return {"bytes": nbytes}


def batch_metrics(run: RLRun, batch: RolloutBatch, trained: RolloutBatch) -> dict[str, float]:
    """Reward, length, rollout-vs-trainer logprob drift and the environment's turns, tool calls and finish
    reasons over the global batch (one all-reduce). Response lengths count generated tokens only. The drift
    is over the samples the trainer ran (`trained`, with their old logprobs): all of them, or those of
    `zero_advantage_split`."""
    mask = batch.response_mask.bool()
    trained_mask = trained.response_mask.bool()
    diff = (trained.rollout_logprobs - trained.old_logprobs).abs()[trained_mask]
    n, tokens, rewards, truncated, diff_sum, diff_tokens, turns, calls, *ended = run.global_sums([
        float(len(batch)), float(mask.sum()), float(batch.rewards.sum()),
        float(sum(r == "length" for r in batch.finish_reasons)), float(diff.sum()), float(diff.numel()),
        float(batch.turns.sum()), float(batch.tool_calls.sum()),
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
        "env/turns_mean": turns / n,
        "env/tool_calls_mean": calls / n,
        **{f"env/ended_by/{reason}": count / n for reason, count in zip(FINISH_REASONS, ended)},
    }


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
    most `train.micro_batch_tokens` tokens (which need each sample's length)."""
    if not train.micro_batch_tokens:
        return {"micro_batch_size": train.micro_batch_size}
    return {"micro_batch_size": train.micro_batch_size, "micro_batch_tokens": train.micro_batch_tokens,
            "lengths": sequence_lengths(batch.response_mask, batch.prompt_lens)}


# ---- the run ---------------------------------------------------------------------------------------------
def train(cfg: Config) -> Path:
    """Run the recipe; returns the directory of the final checkpoint."""
    from transformers import AutoTokenizer

    if cfg.placement.mode == "split" and is_rollout_rank(cfg):
        serve_rollout(cfg)  # until the training ranks are done
        return final_dir(cfg)
    groups = init_groups(cfg)
    check_launch(cfg)
    resume_from, done = find_resume(cfg)
    if already_finished(cfg, resume_from, done, cfg.train.steps):
        if cfg.placement.mode == "split" and dist.get_rank() == 0:
            dismiss_rollout_ranks(cfg)  # they wait for commands that will not come
        return final_dir(cfg)
    data = cfg.data
    fields = dict(prompt_key=data.prompt_key, answer_key=data.answer_key, metadata_key=data.metadata_key,
                  skip_bad_rows=data.skip_bad_rows)
    train_rows = load_prompts(data.train_path, **fields)
    eval_rows = load_prompts(data.eval_path, **fields)[: data.eval_prompts] if data.eval_path else []
    if any(term.kind == "code" for term in cfg.reward.terms):
        check_test_specs(train_rows, where=data.train_path)
        check_test_specs(eval_rows, where=data.eval_path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model_dir = sft_warmup(cfg, groups, tokenizer, train_rows) if cfg.warmup.sft_steps else cfg.model.path
    run = build_run(cfg, groups, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
                    model_dir=model_dir, split=SplitRollout(cfg, groups) if cfg.placement.mode == "split" else None)

    def load_extra(saved: dict) -> None:
        run.kl.load_state_dict(saved["kl"])
        run.weight_version = saved["weight_version"]

    split = run.split
    state = RunState(groups=groups, engines=run.trained_engines(), sampler=run.sampler, rollout=run.rollout,
                     placement=run.placement, resident=partial(trainer_resident, run),
                     extra=lambda: {"weight_version": run.weight_version, "kl": run.kl.state_dict(),
                                    **({"split": split.state()} if split else {})},
                     load_extra=load_extra,
                     save_files=(lambda path, step: split.save(path, step=step)) if split else None,
                     load_files=(lambda path, saved, step: split.restore(path, saved, step=step)) if split else None)
    try:
        # the first push hands over the trainer's own (or restored) weights, which also proves the name table
        return run_steps(cfg, state, step=partial(rl_step, run), steps=cfg.train.steps, resume_from=resume_from,
                         desc="rl", on_start=lambda: hand_over(run, PhaseTimer()))
    finally:
        if run.split is not None:
            run.split.close()
        run.scorer.close()
        if run.env_workers is not None:
            run.env_workers.retire()
        if run.rollout is not None:
            run.rollout.shutdown()
