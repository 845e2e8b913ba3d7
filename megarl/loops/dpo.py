"""The DPO loop: preference pairs, a frozen reference model, one DPO (or IPO) step per global batch of pairs.

    megarl train recipes/dpo_tiny.yaml        # algo.name: dpo

A global batch is `data.prompts_per_step` pairs; each data-parallel rank takes its slice from the shared
seeded sampler. The reference model's summed response logprobs are computed once per batch, forward only,
then the actor takes one step on `dpo_loss`, a mean over all pairs of the global batch.

Batch layout: pairs are interleaved, sequence 2k is pair k's chosen response and 2k+1 its rejected one, and
`train.micro_batch_size` must be even. So no micro-batch ever splits a pair (each pair's loss is computed
where both of its sequences are), and the layout is the same for every micro batch size and every
data-parallel split, so the reference logprobs line up with the actor's row by row. Concatenating
[chosen; rejected] per micro-batch would also keep pairs whole, but would tie the order of the batch to the
micro batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torch import Tensor

from megarl.algo.aggregate import group_sums, masked_sum
from megarl.algo.losses import dpo_loss
from megarl.config import Config, DPOConfig
from megarl.data.prompts import PromptSampler
from megarl.data.supervised import Example, encode_pair, load_preference_pairs, pad_examples
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups
from megarl.engine.roles import BasePolicy, build_engine
from megarl.job import Job
from megarl.loops.launch import launch
from megarl.loops.lifecycle import final_dir, run_steps
from megarl.loops.resume import RunState, already_finished, find_resume
from megarl.loops.sft import offline_step, total_steps

Pair = tuple[Example, Example]  # (chosen, rejected), tokenized


@dataclass
class DPORun:
    """Everything one DPO run holds, built once from the recipe."""

    cfg: Config
    groups: ParallelGroups
    actor: TrainEngine
    reference: TrainEngine | BasePolicy  # frozen: no optimizer, no gradients (model.lora: the actor, adapters off)
    train_pairs: list[Pair]
    eval_pairs: list[Pair]            # this rank's share of the held-out pairs
    sampler: PromptSampler
    pairs_per_rank: int
    pad_id: int


# ---- one step ----------------------------------------------------------------------------------------------
def dpo_step(run: DPORun) -> dict[str, float]:
    """One actor update on the next global batch of pairs; metrics are means over all its pairs."""
    cfg, micro = run.cfg, run.cfg.train.micro_batch_size
    pairs = [run.train_pairs[i] for i in run.sampler.next_batch(run.pairs_per_rank)]
    tokens, mask = interleave(pairs, pad_id=run.pad_id)
    ref_logprobs = sequence_logprobs(run.reference, tokens, mask, micro_batch_size=micro)
    loss_fn = partial(preference_loss, dpo=cfg.dpo, pairs=run.pairs_per_rank * run.groups.dp_size)
    return run.actor.train_step(tokens, {"response_mask": mask, "ref_logprobs": ref_logprobs}, loss_fn,
                                temperature=1.0, micro_batch_size=micro)


def interleave(pairs: list[Pair], *, pad_id: int) -> tuple[Tensor, Tensor]:
    """Tokens [2P, T] and response mask [2P, T]: row 2k is pair k's chosen sequence, row 2k+1 its rejected."""
    return pad_examples([example for pair in pairs for example in pair], pad_id=pad_id)


def sequence_logprobs(engine: TrainEngine | BasePolicy, tokens: Tensor, mask: Tensor, *, micro_batch_size: int) -> Tensor:
    """Summed response logprobs [B] of `tokens` [B, T] under `engine`, forward only, at temperature 1."""
    return masked_sum(engine.logprobs(tokens, temperature=1.0, micro_batch_size=micro_batch_size), mask, dim=-1)


def preference_loss(logprobs: Tensor, mb: dict[str, Tensor], *, dpo: DPOConfig, pairs: int) -> tuple[Tensor, dict]:
    """`dpo_loss` of one micro-batch's pairs as a contribution to the mean over the global batch's `pairs`.

    logprobs, mb["response_mask"]: [b, T], rows interleaved (chosen, rejected); mb["ref_logprobs"]: [b],
    the reference's summed response logprobs. Statistics are contributions to global means over pairs:
    reward_accuracy (fraction of pairs whose chosen reward is higher), rewards/chosen, rewards/rejected and
    rewards/margin (beta-scaled log-ratios to the reference, as in Rafailov et al. 2023).
    """
    summed = masked_sum(logprobs, mb["response_mask"], dim=-1)  # [b]
    ref = mb["ref_logprobs"]
    losses, stats = dpo_loss(summed[0::2], summed[1::2], ref[0::2], ref[1::2], beta=dpo.beta, kind=dpo.loss,
                             label_smoothing=dpo.label_smoothing)
    loss = losses.sum() / pairs
    chosen, rejected = stats["chosen_rewards"], stats["rejected_rewards"]
    return loss, {"loss": loss.detach(), "reward_accuracy": stats["reward_accuracy"].sum() / pairs,
                  "rewards/chosen": chosen.sum() / pairs, "rewards/rejected": rejected.sum() / pairs,
                  "rewards/margin": (chosen - rejected).sum() / pairs}


def evaluate(run: DPORun) -> dict[str, float]:
    """Loss, reward accuracy and margin on the held-out pairs (forward only), means over all ranks' pairs."""
    pairs_per_chunk = run.cfg.train.micro_batch_size // 2
    n_pairs = group_sums([float(len(run.eval_pairs))], group=run.groups.dp)[0]
    keys = ("loss", "reward_accuracy", "rewards/margin")
    totals = [0.0] * len(keys)
    for i in range(0, len(run.eval_pairs), pairs_per_chunk):
        tokens, mask = interleave(run.eval_pairs[i:i + pairs_per_chunk], pad_id=run.pad_id)
        seqs = tokens.shape[0]
        batch = {"response_mask": mask,
                 "ref_logprobs": sequence_logprobs(run.reference, tokens, mask, micro_batch_size=seqs)}
        logprobs = run.actor.logprobs(tokens, temperature=1.0, micro_batch_size=seqs)
        _, stats = preference_loss(logprobs, batch, dpo=run.cfg.dpo, pairs=n_pairs)
        totals = [t + float(stats[k]) for t, k in zip(totals, keys)]
    return {f"eval/{k}": v for k, v in zip(keys, group_sums(totals, group=run.groups.dp))}


# ---- the run -----------------------------------------------------------------------------------------------
def build_run(job: Job, groups: ParallelGroups) -> DPORun:
    """Tokenize the pairs (a malformed one stops here, before any model is built) and build both engines."""
    from transformers import AutoTokenizer

    cfg = job.cfg
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    train_pairs, eval_pairs = encoded_pairs(cfg, tokenizer)
    actor = build_engine(job, job.role("actor"), groups)
    reference = build_engine(job, job.role("reference"), groups, actor=actor)
    return DPORun(cfg=cfg, groups=groups, actor=actor, reference=reference,
                  train_pairs=train_pairs, eval_pairs=eval_pairs[groups.dp_rank::groups.dp_size],
                  sampler=pair_sampler(cfg, groups, len(train_pairs)),
                  pairs_per_rank=cfg.data.prompts_per_step // groups.dp_size,  # they divide (megarl.layout)
                  pad_id=tokenizer.pad_token_id)


def encoded_pairs(cfg: Config, tokenizer) -> tuple[list[Pair], list[Pair]]:
    """The recipe's train pairs and its first data.eval_prompts held-out pairs, tokenized (a malformed row stops
    here, naming its file and line)."""
    data = cfg.data
    load = partial(load_preference_pairs, prompt_key=data.prompt_key, chosen_key=data.chosen_key,
                   rejected_key=data.rejected_key)
    encode = partial(encode_pair, tokenizer, chat_template=data.chat_template)
    train_pairs = [encode(pair) for pair in load(data.train_path)]
    eval_pairs = [encode(pair) for pair in load(data.eval_path)[:data.eval_prompts]] if data.eval_path else []
    return train_pairs, eval_pairs


def pair_sampler(cfg: Config, groups: ParallelGroups, count: int) -> PromptSampler:
    return PromptSampler(count, seed=cfg.seed, shuffle=cfg.data.shuffle, dp_rank=groups.dp_rank,
                         dp_size=groups.dp_size)


def train_on_pairs(cfg: Config, run, *, step, evaluate, engines: dict[str, TrainEngine], desc: str,
                   exported: str = "actor") -> Path:
    """The lifecycle of a loop over preference pairs (DPO, the reward model): `step(run)` per step over
    run.train_pairs, `evaluate(run)` when any data-parallel rank holds held-out pairs, `engines` saved."""
    steps = total_steps(cfg, len(run.train_pairs))
    resume_from, done = find_resume(cfg)
    if already_finished(cfg, resume_from, done, steps):
        return final_dir(cfg)
    has_eval = group_sums([float(len(run.eval_pairs))], group=run.groups.dp)[0] > 0
    update = offline_step(cfg, partial(step, run), evaluate=partial(evaluate, run) if has_eval else None,
                          steps=steps, desc=desc)
    state = RunState(groups=run.groups, engines=engines, sampler=run.sampler)
    return run_steps(cfg, state, step=update, steps=steps, resume_from=resume_from, desc=desc, exported=exported)


def train(cfg: Config) -> Path:
    """Run a DPO recipe; returns the directory of the final checkpoint."""
    run = build_run(*launch(cfg))  # a checkpoint saves the actor; the reference is rebuilt
    return train_on_pairs(cfg, run, step=dpo_step, evaluate=evaluate, engines={"actor": run.actor}, desc="dpo")
