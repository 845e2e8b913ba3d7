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
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm

from megarl.algo.advantages import (broadcast_to_tokens, grpo_advantages, reinforce_pp_baseline_advantages,
                                     rloo_advantages)
from megarl.algo.aggregate import LossNorm, aggregate, global_loss_norm
from megarl.algo.kl import kl_estimate
from megarl.algo.losses import ppo_clip_loss, sft_loss
from megarl.batch import RolloutBatch, pack_sequences
from megarl.checkpoint import save_hf
from megarl.config import Config, RecipeError, dump_config
from megarl.data.prompts import PromptRow, PromptSampler, load_prompts
from megarl.data.supervised import completion_example
from megarl.engine.megatron import ParallelGroups, TrainEngine, check_megatron_fields, init_parallel
from megarl.handoff import push_weights
from megarl.loops.supervised import supervised_step
from megarl.metrics import MetricsWriter, PhaseTimer
from megarl.models.arch import check_layout, read_shape
from megarl.rewards.exact import exact_answer_reward

log = logging.getLogger(__name__)


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
    reference: TrainEngine | None
    rollout: object | None            # the engine, on the first rank of the model-parallel group only
    prompts_per_rank: int
    advantages: Callable[[Tensor, Tensor, Tensor], Tensor]  # (rewards [B], group_ids [B], mask [B, T]) -> [B, T]
    weight_version: int = 0

    @property
    def is_rollout_rank(self) -> bool:
        return self.rollout is not None

    def trainer_engines(self) -> list[TrainEngine]:
        return [self.actor] + ([self.reference] if self.reference is not None else [])


# ---- one step -----------------------------------------------------------------------------------------
def rl_step(run: RLRun, step: int) -> dict[str, float]:
    cfg, timer = run.cfg, PhaseTimer()
    with timer("generate"):
        batch = generate(run, [run.train_rows[i] for i in run.sampler.next_batch(run.prompts_per_rank)],
                         n_samples=cfg.rollout.n_samples)
    with timer("release_rollout"):
        on_rollout_rank(run, "release_memory")
    with timer("wake_trainer"):
        for engine in run.trainer_engines():
            engine.onload()
    with timer("reward"):
        batch, reward_failures = score(batch)
    with timer("logprobs"):
        batch = compute_logprobs(run, batch)
    with timer("advantages"):
        batch = batch.replace(advantages=run.advantages(batch.rewards, batch.group_ids, batch.response_mask))
    with timer("train"):
        train_metrics = train_policy(run, batch, step=step)
    with timer("sleep_trainer"):
        run.actor.offload_training_state()
    with timer("push"):
        push_stats = push_policy(run)
    with timer("wake_rollout"):
        for engine in run.trainer_engines():
            engine.offload_params()
        on_rollout_rank(run, "resume_cache")
    with timer("eval"):
        eval_metrics = evaluate(run) if run.eval_rows and step % cfg.data.eval_every == 0 else {}
    seconds = sum(timer.seconds.values())
    return {
        **batch_metrics(run, batch, reward_failures=reward_failures),
        **train_metrics, **eval_metrics, **timer.metrics(),
        "handoff/bytes": float(push_stats["bytes"]),
        "throughput/tokens_per_s": global_sum(run, float(batch.prompt_lens.sum() + batch.response_mask.sum()))
        / seconds,
    }


# ---- phases -------------------------------------------------------------------------------------------
def generate(run: RLRun, rows: list[PromptRow], *, n_samples: int) -> RolloutBatch:
    """Sample `n_samples` responses for each row on this group's rollout engine; all ranks get the batch."""
    cfg = run.cfg.rollout
    encoded = [encode_prompt(run.tokenizer, row.prompt, chat_template=run.cfg.data.chat_template) for row in rows]
    prompts = [ids for ids in encoded for _ in range(n_samples)]
    result = [None]
    if run.is_rollout_rank:
        gen = run.rollout.generate(prompts, temperature=cfg.temperature, top_p=cfg.top_p,
                                   max_new_tokens=cfg.max_new_tokens, eos_id=run.tokenizer.eos_token_id,
                                   pad_id=run.tokenizer.pad_token_id)
        result = [gen]
    if dist.get_world_size(run.groups.mp) > 1:
        dist.broadcast_object_list(result, src=run.groups.mp_src_global_rank, group=run.groups.mp)
    gen = result[0]
    tokens, mask, rollout_logprobs = pack_sequences(prompts, gen.response_ids, gen.logprobs,
                                                    pad_id=run.tokenizer.pad_token_id)
    return RolloutBatch(
        tokens=tokens, response_mask=mask, rollout_logprobs=rollout_logprobs,
        prompt_lens=torch.tensor([len(p) for p in prompts]),
        group_ids=torch.arange(len(rows)).repeat_interleave(n_samples),
        responses=[run.tokenizer.decode(r, skip_special_tokens=True) for r in gen.response_ids],
        answers=[row.answer for row in rows for _ in range(n_samples)],
        finish_reasons=gen.finish_reasons,
    )


def score(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """Exact-answer rewards [B]; a reward that raises or returns NaN scores 0 and is counted."""
    rewards, failures = [], 0
    for response, answer in zip(batch.responses, batch.answers):
        try:
            value = float(exact_answer_reward(response, answer))
            if math.isnan(value):
                raise ValueError("reward is NaN")
        except Exception as e:  # noqa: BLE001 - a reward must never end the run
            if failures == 0:
                log.warning("reward failed on response %r: %s", response[:200], e)
            value, failures = 0.0, failures + 1
        rewards.append(value)
    return batch.replace(rewards=torch.tensor(rewards)), failures


def compute_logprobs(run: RLRun, batch: RolloutBatch) -> RolloutBatch:
    kwargs = dict(temperature=run.cfg.rollout.temperature, micro_batch_size=run.cfg.train.micro_batch_size)
    old = run.actor.logprobs(batch.tokens, **kwargs) * batch.response_mask
    ref = run.reference.logprobs(batch.tokens, **kwargs) * batch.response_mask if run.reference else None
    return batch.replace(old_logprobs=old, ref_logprobs=ref)


def policy_loss(logprobs: Tensor, mb: dict[str, Tensor], *, algo, norm: LossNorm) -> tuple[Tensor, dict]:
    """PPO-clip policy loss (+ KL to the reference as a loss term) of one micro-batch, as a contribution
    to the global-batch loss; statistics are token means over the global batch."""
    mask = mb["response_mask"]
    per_token, stats = ppo_clip_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask,
                                     clip_low=algo.clip_low, clip_high=algo.clip_high)
    loss = aggregate(per_token, mask, mode=algo.loss_agg, norm=norm)
    token_mean = partial(aggregate, mask=mask, mode="token-mean", norm=norm)
    out = {"pg_loss": loss.detach(), "clipfrac": token_mean(stats["clipped"]),
           "ppo_kl": token_mean(stats["approx_kl"])}
    if "ref_logprobs" in mb:
        kl = token_mean(kl_estimate(logprobs, mb["ref_logprobs"], kind=algo.kl_estimator))
        loss = loss + algo.kl_coef * kl
        out["kl"] = kl.detach()
    out["loss"] = loss.detach()
    return loss, out


def train_policy(run: RLRun, batch: RolloutBatch, *, step: int) -> dict[str, float]:
    cfg = run.cfg
    norm = dataclasses.replace(global_loss_norm(batch.response_mask, group=run.groups.dp),
                               max_len=cfg.rollout.max_new_tokens)
    extras = {"response_mask": batch.response_mask, "old_logprobs": batch.old_logprobs,
              "advantages": batch.advantages}
    if batch.ref_logprobs is not None:
        extras["ref_logprobs"] = batch.ref_logprobs
    run.actor.set_lr(learning_rate(cfg.optim, run.actor.step))
    metrics: dict[str, float] = {}
    for _ in range(cfg.algo.epochs):
        metrics = run.actor.train_step(batch.tokens, extras, partial(policy_loss, algo=cfg.algo, norm=norm),
                                       temperature=cfg.rollout.temperature,
                                       micro_batch_size=cfg.train.micro_batch_size)
    if not math.isfinite(metrics["loss"]) or not math.isfinite(metrics["grad_norm"]):
        path = Path(cfg.run_dir) / f"bad_batch_step{step}_rank{dist.get_rank()}.pt"
        batch.save(path)
        raise FloatingPointError(f"step {step}: loss {metrics['loss']}, grad norm {metrics['grad_norm']} "
                                 f"is not finite; the batch is saved to {path} to replay it")
    return metrics


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
    batch, _ = score(generate(run, rows, n_samples=1))
    total = global_sum(run, float(batch.rewards.sum()))
    return {"eval/reward_mean": total / global_sum(run, float(len(batch)))}


def batch_metrics(run: RLRun, batch: RolloutBatch, *, reward_failures: int) -> dict[str, float]:
    """Reward, length and rollout-vs-trainer logprob drift over the global batch."""
    mask = batch.response_mask.bool()
    diff = (batch.rollout_logprobs - batch.old_logprobs).abs()[mask]
    n = global_sum(run, float(len(batch)))
    tokens = global_sum(run, float(mask.sum()))
    diff_max = torch.tensor([float(diff.max()) if diff.numel() else 0.0])
    if run.groups.dp_size > 1:
        dist.all_reduce(diff_max, op=dist.ReduceOp.MAX, group=run.groups.dp)
    return {
        "reward/mean": global_sum(run, float(batch.rewards.sum())) / n,
        "reward/failures": global_sum(run, float(reward_failures)),
        "response/len_mean": tokens / n,
        "response/truncated_frac": global_sum(run, float(sum(r == "length" for r in batch.finish_reasons))) / n,
        "rollout/logprob_diff_mean": global_sum(run, float(diff.sum())) / max(tokens, 1.0),
        "rollout/logprob_diff_max": float(diff_max),
    }


# ---- helpers ----------------------------------------------------------------------------------------
def on_rollout_rank(run: RLRun, method: str) -> None:
    """Call a memory method of the rollout engine on the rank that holds it."""
    if run.is_rollout_rank:
        getattr(run.rollout, method)()


def encode_prompt(tokenizer, prompt: str, *, chat_template: bool) -> list[int]:
    """Prompt token ids, wrapped as a user turn in the tokenizer's chat template when asked.

    The template is rendered to text and then tokenized, because `apply_chat_template(tokenize=True)`
    returns a list in some transformers releases and a BatchEncoding in others.
    """
    if chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def global_sum(run: RLRun, value: float) -> float:
    if run.groups.dp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=run.groups.dp)
    return float(t)


def learning_rate(optim, step: int) -> float:
    """Linear warmup over `optim.warmup_steps` optimizer steps, then constant."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    return optim.lr


def advantage_fn(algo, groups: ParallelGroups) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The recipe's advantage estimator as (rewards [B], group_ids [B], response_mask [B, T]) -> [B, T]."""
    def per_sequence(estimator):
        return lambda rewards, group_ids, mask: broadcast_to_tokens(estimator(rewards, group_ids), mask)

    match algo.name:
        case "grpo":
            return per_sequence(partial(grpo_advantages, std_norm=algo.std_norm))
        case "dr_grpo":
            return per_sequence(partial(grpo_advantages, std_norm=False))
        case "rloo":
            return per_sequence(rloo_advantages)
        case "reinforce_pp":
            return partial(reinforce_pp_baseline_advantages, group=groups.dp)
    raise RecipeError(f"algo.name: unknown estimator {algo.name!r}")


def make_rollout_engine(cfg: Config, model_dir: str):
    match cfg.rollout.engine:
        case "native":
            from megarl.rollout.native import NativeEngine

            return NativeEngine(model_dir, dtype=cfg.model.dtype, seed=cfg.seed + dist.get_rank())
        case "sglang":
            from megarl.rollout.sglang_engine import SGLangEngine

            return SGLangEngine(model_dir, dtype=cfg.model.dtype, seed=cfg.seed + dist.get_rank(),
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
    """Write the model as an HF checkpoint from global rank 0; its model-parallel peers join the gathers."""
    if groups.dp_rank == 0:
        tensors = engine.pipeline_hf_tensors()
        if dist.get_rank() == 0:
            save_hf(tensors, source_dir=source_dir, out_dir=out_dir, meta=meta)
        else:
            for _ in tensors:
                pass
    dist.barrier()


# ---- the run ---------------------------------------------------------------------------------------------
def check_launch(cfg: Config, groups: ParallelGroups) -> None:
    """Batch sizes against this launch's data-parallel size; RecipeError names the keys."""
    check_megatron_fields(cfg.model.megatron)
    dp = groups.dp_size
    if cfg.data.prompts_per_step % dp:
        raise RecipeError(f"data.prompts_per_step={cfg.data.prompts_per_step} is not divisible by the "
                          f"data-parallel size {dp} (world size / (parallel.tp * parallel.pp * parallel.cp))")
    samples = cfg.data.prompts_per_step // dp * cfg.rollout.n_samples
    if samples % cfg.train.micro_batch_size:
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
    rollout = make_rollout_engine(cfg, model_dir) if dist.get_rank() == groups.mp_src_global_rank else None
    sampler = PromptSampler(len(train_rows), seed=cfg.seed, shuffle=cfg.data.shuffle, dp_rank=groups.dp_rank,
                            dp_size=groups.dp_size)
    return RLRun(cfg=cfg, groups=groups, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
                 sampler=sampler, actor=actor, reference=reference, rollout=rollout,
                 prompts_per_rank=cfg.data.prompts_per_step // groups.dp_size,
                 advantages=advantage_fn(cfg.algo, groups))


def train(cfg: Config) -> Path:
    """Run the recipe; returns the directory of the final checkpoint."""
    from transformers import AutoTokenizer

    run_dir = Path(cfg.run_dir)
    try:
        shape = read_shape(cfg.model.path)
    except ValueError as e:
        raise RecipeError(f"model.path: {e}") from None
    par = cfg.parallel
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_layout(shape, tp=par.tp, pp=par.pp, cp=par.cp, world_size=world_size)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    try:
        groups = init_parallel(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep, cp=cfg.parallel.cp,
                               seed=cfg.seed)
    except ValueError as e:
        raise RecipeError(f"parallel: {e}") from None
    check_launch(cfg, groups)
    data = cfg.data
    train_rows = load_prompts(data.train_path, prompt_key=data.prompt_key, answer_key=data.answer_key)
    eval_rows = load_prompts(data.eval_path, prompt_key=data.prompt_key,
                             answer_key=data.answer_key)[: data.eval_prompts] if data.eval_path else []
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model_dir = sft_warmup(cfg, groups, tokenizer, train_rows) if cfg.warmup.sft_steps else cfg.model.path
    run = build_run(cfg, groups, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows,
                    model_dir=model_dir)
    if dist.get_rank() == 0:
        dump_config(cfg, run_dir / "recipe.yaml")
    writer = MetricsWriter(run_dir, total_steps=cfg.train.steps, enabled=dist.get_rank() == 0,
                           progress=cfg.log.progress, tensorboard=cfg.log.tensorboard)
    final = run_dir / "checkpoints" / "final"
    try:
        push_policy(run)  # version 1: the trainer's own weights, which also proves the name table
        for step in range(1, cfg.train.steps + 1):
            metrics = rl_step(run, step)
            if step % cfg.log.every_steps == 0 or step == cfg.train.steps:
                writer.write(step, metrics)
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                export_policy(run.actor, run.groups, source_dir=cfg.model.path,
                              out_dir=run_dir / "checkpoints" / f"step{step:06d}", meta={"step": step})
        if cfg.checkpoint.save_final:
            export_policy(run.actor, run.groups, source_dir=cfg.model.path, out_dir=final,
                          meta={"step": cfg.train.steps})
    finally:
        writer.close()
        if run.rollout is not None:
            run.rollout.shutdown()
    return final
