"""The supervised warm start of an RL run: a few SFT steps on the train set's answers before RL, for models
that would never earn a reward from sampling alone (`warmup:` in the recipe)."""

from __future__ import annotations

import logging
import math
import sys

import torch.distributed as dist
from tqdm import tqdm

from megarl.job import Job, warm_start_dir
from megarl.data.prompts import PromptRow, PromptSampler, encode_prompt
from megarl.data.supervised import completion_example
from megarl.device import release_cached_blocks
from megarl.engine.parallel import ParallelGroups
from megarl.engine.roles import build_engine
from megarl.loops.lifecycle import export_policy
from megarl.loops.supervised import supervised_step
from megarl.metrics import ProgressLines

log = logging.getLogger(__name__)


def sft_warmup(job: Job, groups: ParallelGroups, tokenizer, rows: list[PromptRow]) -> str:
    """Supervised steps on the train set's answers; returns the HF directory RL starts from.

    Each example is the prompt as RL encodes it, then the answer and EOS, as a rollout should end. Steps
    stop at `warmup.sft_steps`, or earlier once the mean probability of the whole answer reaches
    `warmup.stop_answer_prob`. The result is exported to RUN_DIR/warmup, so the actor, the reference and the
    rollout engine all start from the same weights, and a rerun reuses it instead of training again.
    """
    cfg = job.cfg
    out = warm_start_dir(cfg)
    if (out / "megarl_checkpoint.json").exists():
        log.info("reusing supervised warm start in %s", out)
        return str(out)
    engine = build_engine(job, job.warm_start, groups)
    sampler = PromptSampler(len(rows), seed=cfg.seed + 1, dp_rank=groups.dp_rank, dp_size=groups.dp_size)
    per_rank = cfg.warmup.batch_size // groups.dp_size
    console = cfg.log.progress and dist.get_rank() == 0
    bar = tqdm(total=cfg.warmup.sft_steps, desc="sft warm start", dynamic_ncols=True,
               disable=not (console and sys.stderr.isatty()))
    lines = ProgressLines("sft warm start", cfg.warmup.sft_steps, enabled=console)  # a log file's progress
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
        lines.update(step + 1, {"nll": metrics["loss"], "answer_prob": metrics["response_prob"]})
        if metrics["response_prob"] >= cfg.warmup.stop_answer_prob:
            break
    bar.close()
    steps, prob = step + 1, metrics["response_prob"]
    ended = (f"stopped early after {steps} of {cfg.warmup.sft_steps} steps: answer probability {prob:.3f} "
             f"reached warmup.stop_answer_prob {cfg.warmup.stop_answer_prob}"
             if steps < cfg.warmup.sft_steps else f"{steps} steps, answer probability {prob:.3f}")
    if console:
        print(f"megarl: sft warm start: {ended}", file=sys.stderr, flush=True)
    log.info("supervised warm start: %s", ended)
    export_policy(engine, groups, source_dir=cfg.model.path, out_dir=out,
                  meta={"stage": "sft_warmup", "steps": step + 1, "answer_prob": metrics["response_prob"]})
    # The rollout engines start next and size their memory from what is free: give back all of this engine's.
    engine.free()
    release_cached_blocks()
    return str(out)
