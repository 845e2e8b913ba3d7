"""The SFT loop: one supervised step per global batch of SFT rows, held-out loss, HF export at the end.

    megarl train recipes/sft_tiny.yaml        # algo.name: sft

Every rank runs the same loop (SPMD under torchrun). A global batch is `data.prompts_per_step` rows; each
data-parallel rank takes its slice from the shared seeded sampler, and the loss is the token mean of the
response NLL over the whole global batch (`megarl.loops.supervised`). Rows are tokenized once, before the
first step, so a malformed row stops the run before any work.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from megarl.algo.aggregate import group_sums, masked_sum
from megarl.config import Config, RecipeError
from megarl.data.prompts import PromptSampler
from megarl.data.supervised import Example, encode_sft_row, load_sft_rows, pad_examples
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups
from megarl.engine.roles import build_engine
from megarl.loops.launch import launch
from megarl.loops.lifecycle import final_dir, run_steps
from megarl.loops.resume import RunState, already_finished, find_resume
from megarl.loops.supervised import packing, supervised_step
from megarl.metrics import check_finite


def total_steps(cfg: Config, n_rows: int) -> int:
    """`train.epochs` passes over `n_rows` rows (the last batch runs into the next epoch), else `train.steps`."""
    if cfg.train.epochs:
        return math.ceil(cfg.train.epochs * n_rows / cfg.data.prompts_per_step)
    return cfg.train.steps


# ---- evaluation --------------------------------------------------------------------------------------------
def heldout_loss(engine: TrainEngine, examples: list[Example], *, pad_id: int, groups: ParallelGroups,
                 micro_batch_size: int, micro_batch_tokens: int | None = None) -> float:
    """Token-mean NLL of the trained tokens of the held-out set; denominator: its trained tokens on all
    data-parallel ranks. `examples` is this rank's share (the ranks' shares together are the set)."""
    nll = tokens = 0.0
    for i in range(0, len(examples), micro_batch_size):
        chunk = examples[i:i + micro_batch_size]
        ids, mask = pad_examples(chunk, pad_id=pad_id)
        logprobs = engine.logprobs(ids, temperature=1.0, micro_batch_size=len(chunk),
                                   **packing(chunk, micro_batch_tokens))
        nll += float(masked_sum(-logprobs, mask))
        tokens += float(mask.sum())
    nll, tokens = group_sums([nll, tokens], group=groups.dp)
    return nll / max(tokens, 1.0)


# ---- the run -----------------------------------------------------------------------------------------------
def train(cfg: Config) -> Path:
    """Run an SFT recipe; returns the directory of the final checkpoint."""
    from transformers import AutoTokenizer

    job, groups = launch(cfg)
    per_rank = cfg.data.prompts_per_step // groups.dp_size  # they divide (megarl.layout, at launch)
    data = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    load = partial(load_sft_rows, prompt_key=data.prompt_key, response_key=data.response_key,
                   messages_key=data.messages_key)
    encode = partial(encode_sft_row, tokenizer, chat_template=data.chat_template)
    train_set = [encode(row) for row in load(data.train_path)]
    eval_set = [encode(row) for row in load(data.eval_path)[:data.eval_prompts]] if data.eval_path else []
    check_packing(cfg.train.micro_batch_tokens, {data.train_path: train_set, data.eval_path: eval_set})
    my_eval = eval_set[groups.dp_rank::groups.dp_size]
    steps = total_steps(cfg, len(train_set))
    resume_from, done = find_resume(cfg)
    if already_finished(cfg, resume_from, done, steps):
        return final_dir(cfg)

    engine = build_engine(job, job.role("actor"), groups)
    sampler = PromptSampler(len(train_set), seed=cfg.seed, shuffle=data.shuffle, dp_rank=groups.dp_rank,
                            dp_size=groups.dp_size)
    step_kwargs = dict(pad_id=tokenizer.pad_token_id, micro_batch_size=cfg.train.micro_batch_size,
                       micro_batch_tokens=cfg.train.micro_batch_tokens)

    def update() -> dict[str, float]:
        batch = [train_set[i] for i in sampler.next_batch(per_rank)]
        return supervised_step(engine, batch, group=groups.dp, **step_kwargs)

    def evaluate() -> dict[str, float]:
        return {"eval/loss": heldout_loss(engine, my_eval, groups=groups, **step_kwargs)}

    state = RunState(groups=groups, engines={"actor": engine}, sampler=sampler)  # a reference is rebuilt
    step = offline_step(cfg, update, evaluate=evaluate if eval_set else None, steps=steps, desc="sft")
    return run_steps(cfg, state, step=step, steps=steps, resume_from=resume_from, desc="sft")


def check_packing(micro_batch_tokens: int | None, sets: dict[str, list[Example]]) -> None:
    """With sequence packing, every example fits in a micro-batch: a RecipeError naming the file and row of
    the first that does not, before any work."""
    if not micro_batch_tokens:
        return
    for path, examples in sets.items():
        for row, example in enumerate(examples, start=1):
            if len(example.ids) > micro_batch_tokens:
                raise RecipeError(f"{path}: row {row} is {len(example.ids)} tokens, more than "
                                  f"train.micro_batch_tokens = {micro_batch_tokens} (a packed micro-batch holds "
                                  "whole sequences)")


def offline_step(cfg: Config, update: Callable[[], dict[str, float]], *,
                 evaluate: Callable[[], dict[str, float]] | None, steps: int, desc: str) -> Callable[[int], dict]:
    """One step of the SFT, DPO and reward-model loops: `update()`, timed and stopped on a non-finite
    number, then the held-out evaluation every `data.eval_every` steps, after the first step too (so the
    curve starts near the untrained model) and after the last."""
    def step(n: int) -> dict[str, float]:
        began = time.perf_counter()
        metrics = update()
        check_finite(metrics, step=n, what=desc)
        metrics["timing/step_s"] = time.perf_counter() - began
        if evaluate is not None and (n == 1 or n % cfg.data.eval_every == 0 or n == steps):
            metrics.update(evaluate())
        return metrics
    return step
