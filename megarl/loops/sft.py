"""The SFT loop: one supervised step per global batch of SFT rows, held-out loss, HF export at the end.

    megarl train recipes/sft_tiny.yaml        # algo.name: sft

Every rank runs the same loop (SPMD under torchrun). A global batch is `data.prompts_per_step` rows; each
data-parallel rank takes its slice from the shared seeded sampler, and the loss is the token mean of the
response NLL over the whole global batch (`megarl.loops.supervised`). Rows are tokenized once, before the
first step, so a malformed row stops the run before any work.
"""

from __future__ import annotations

import math
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.algo.aggregate import masked_sum
from megarl.config import Config, RecipeError, dump_config
from megarl.data.prompts import PromptSampler
from megarl.data.supervised import Example, encode_sft_row, load_sft_rows, pad_examples
from megarl.engine.megatron import ParallelGroups, TrainEngine, check_megatron_fields, init_parallel
from megarl.loops.resume import already_finished, find_resume, restore_checkpoint, save_checkpoint
from megarl.loops.rl import export_policy, learning_rate
from megarl.loops.supervised import supervised_step
from megarl.metrics import MetricsWriter
from megarl.models.arch import check_layout, read_shape


# ---- launch ------------------------------------------------------------------------------------------------
def init_groups(cfg: Config) -> ParallelGroups:
    """Check the model and the parallel layout against this launch, then start the parallel state.
    A mismatch is a RecipeError naming the keys, raised before any model is built."""
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
    check_megatron_fields(cfg.model.megatron)
    try:
        return init_parallel(tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp, seed=cfg.seed)
    except ValueError as e:
        raise RecipeError(f"parallel: {e}") from None


def rows_per_rank(cfg: Config, groups: ParallelGroups, *, seqs_per_row: int) -> int:
    """This rank's rows of each global batch; `seqs_per_row` sequences each (2 for a preference pair)."""
    dp, rows, micro = groups.dp_size, cfg.data.prompts_per_step, cfg.train.micro_batch_size
    if rows % dp:
        raise RecipeError(f"data.prompts_per_step={rows} is not divisible by the data-parallel size {dp} "
                          f"(world size / (parallel.tp * parallel.pp * parallel.cp))")
    if rows // dp * seqs_per_row % micro:
        raise RecipeError(f"sequences per data-parallel rank {rows // dp * seqs_per_row} (data.prompts_per_step"
                          f" / {dp}{f' * {seqs_per_row}' if seqs_per_row > 1 else ''}) is not divisible by "
                          f"train.micro_batch_size={micro}")
    return rows // dp


def total_steps(cfg: Config, n_rows: int) -> int:
    """`train.epochs` passes over `n_rows` rows (the last batch runs into the next epoch), else `train.steps`."""
    if cfg.train.epochs:
        return math.ceil(cfg.train.epochs * n_rows / cfg.data.prompts_per_step)
    return cfg.train.steps


def dp_sums(values: list[float], group) -> list[float]:
    """Element-wise sums over the data-parallel ranks (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


def check_finite(metrics: dict[str, float], step: int) -> None:
    if not math.isfinite(metrics["loss"]) or not math.isfinite(metrics["grad_norm"]):
        raise FloatingPointError(f"step {step}: loss {metrics['loss']}, grad norm {metrics['grad_norm']} "
                                 f"is not finite")


# ---- evaluation --------------------------------------------------------------------------------------------
def heldout_loss(engine: TrainEngine, examples: list[Example], *, pad_id: int, groups: ParallelGroups,
                 micro_batch_size: int) -> float:
    """Token-mean NLL of the trained tokens of the held-out set; denominator: its trained tokens on all
    data-parallel ranks. `examples` is this rank's share (the ranks' shares together are the set)."""
    nll = tokens = 0.0
    for i in range(0, len(examples), micro_batch_size):
        chunk = examples[i:i + micro_batch_size]
        ids, mask = pad_examples(chunk, pad_id=pad_id)
        logprobs = engine.logprobs(ids, temperature=1.0, micro_batch_size=len(chunk))
        nll += float(masked_sum(-logprobs, mask))
        tokens += float(mask.sum())
    nll, tokens = dp_sums([nll, tokens], groups.dp)
    return nll / max(tokens, 1.0)


# ---- the run -----------------------------------------------------------------------------------------------
def train(cfg: Config) -> Path:
    """Run an SFT recipe; returns the directory of the final checkpoint."""
    from transformers import AutoTokenizer

    groups = init_groups(cfg)
    per_rank = rows_per_rank(cfg, groups, seqs_per_row=1)
    data, run_dir = cfg.data, Path(cfg.run_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    load = partial(load_sft_rows, prompt_key=data.prompt_key, response_key=data.response_key,
                   messages_key=data.messages_key)
    encode = partial(encode_sft_row, tokenizer, chat_template=data.chat_template)
    train_set = [encode(row) for row in load(data.train_path)]
    eval_set = [encode(row) for row in load(data.eval_path)[:data.eval_prompts]] if data.eval_path else []
    my_eval = eval_set[groups.dp_rank::groups.dp_size]

    engine = TrainEngine(model_dir=cfg.model.path, dtype=cfg.model.dtype, megatron=cfg.model.megatron,
                         groups=groups, optim=cfg.optim)
    sampler = PromptSampler(len(train_set), seed=cfg.seed, shuffle=data.shuffle, dp_rank=groups.dp_rank,
                            dp_size=groups.dp_size)
    steps = total_steps(cfg, len(train_set))
    final = run_dir / "checkpoints" / "final"
    resume_from, start = find_resume(cfg)
    if already_finished(cfg, resume_from, start, steps):
        return final
    checkpoint = partial(save_checkpoint, cfg, groups=groups, engines={"actor": engine}, sampler=sampler)
    if resume_from is not None:
        restore_checkpoint(resume_from, groups=groups, engines={"actor": engine}, sampler=sampler)
    step_kwargs = dict(pad_id=tokenizer.pad_token_id, micro_batch_size=cfg.train.micro_batch_size)
    if dist.get_rank() == 0:
        dump_config(cfg, run_dir / "recipe.yaml")
    writer = MetricsWriter(run_dir, total_steps=steps, enabled=dist.get_rank() == 0, progress=cfg.log.progress,
                           tensorboard=cfg.log.tensorboard, desc="sft", resume_step=start)
    try:
        for step in range(start + 1, steps + 1):
            start = time.perf_counter()
            lr = learning_rate(cfg.optim, engine.step)
            engine.set_lr(lr)
            batch = [train_set[i] for i in sampler.next_batch(per_rank)]
            metrics = supervised_step(engine, batch, group=groups.dp, **step_kwargs)
            check_finite(metrics, step)
            metrics.update({"lr": lr, "timing/step_s": time.perf_counter() - start})
            # after the first step too, so the held-out curve starts near the untrained model
            if eval_set and (step == 1 or step % data.eval_every == 0 or step == steps):
                metrics["eval/loss"] = heldout_loss(engine, my_eval, groups=groups, **step_kwargs)
            if step % cfg.log.every_steps == 0 or step == steps:
                writer.write(step, metrics)
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < steps:
                checkpoint(step)
    finally:
        writer.close()
    if cfg.checkpoint.save_final:
        checkpoint(steps)
        export_policy(engine, groups, source_dir=cfg.model.path, out_dir=final, meta={"stage": "sft", "step": steps})
    return final
