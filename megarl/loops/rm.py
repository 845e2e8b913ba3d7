"""The reward-model loop: a scalar head on the last token, trained with the Bradley-Terry loss on preference
pairs, exported as an HF sequence classifier that the `reward_model` reward term loads.

    megarl train recipes/rm_tiny.yaml         # algo.name: rm

The model is the checkpoint at `model.path` with its vocabulary projection replaced by the critic's scalar head
(megarl.engine.model.ValueHead): read from the checkpoint's `score.weight` when it has one (a reward model
trained further), zero otherwise, so every score starts at 0 and the first step's loss is exactly log 2. A
sequence's score is the head on the hidden state of its last token, the EOS after the response: where the
`reward_model` term reads a finished response's score, and where transformers' sequence classifier reads it.

Pairs are the DPO data format, laid out as the DPO loop lays them out (megarl.loops.dpo): sequence 2k is pair
k's chosen response and 2k+1 its rejected one, `train.micro_batch_size` is even, so no micro-batch splits a
pair. A global batch is `data.prompts_per_step` pairs; the loss is the mean over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from megarl.algo.aggregate import group_sums
from megarl.algo.losses import bradley_terry_loss
from megarl.config import Config
from megarl.data.prompts import PromptSampler
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups
from megarl.engine.roles import build_engine
from megarl.loops.dpo import Pair, encoded_pairs, interleave, pair_sampler, train_on_pairs
from megarl.job import Job
from megarl.loops.launch import launch

EVAL_KEYS = ("loss", "accuracy", "margin")


@dataclass
class RMRun:
    """Everything one reward-model run holds, built once from the recipe."""

    cfg: Config
    groups: ParallelGroups
    model: TrainEngine                # the scalar-head model being trained
    train_pairs: list[Pair]
    eval_pairs: list[Pair]            # this rank's share of the held-out pairs
    sampler: PromptSampler
    pairs_per_rank: int
    pad_id: int


# ---- one step ----------------------------------------------------------------------------------------------
def rm_step(run: RMRun) -> dict[str, float]:
    """One update on the next global batch of pairs; metrics are means over all its pairs."""
    pairs = [run.train_pairs[i] for i in run.sampler.next_batch(run.pairs_per_rank)]
    tokens, last = score_inputs(pairs, pad_id=run.pad_id)
    loss_fn = partial(pair_loss, center_coef=run.cfg.rm.center_coef, pairs=run.pairs_per_rank * run.groups.dp_size)
    return run.model.train_step(tokens, {"last": last}, loss_fn, temperature=1.0,
                                micro_batch_size=run.cfg.train.micro_batch_size)


def score_inputs(pairs: list[Pair], *, pad_id: int) -> tuple[Tensor, Tensor]:
    """Tokens [2P, T + 1] of the interleaved pairs with one padding column appended, and the column [2P] that
    holds each sequence's score. The engine's values put head(h[t - 1]) in column t, so a sequence of n
    tokens is scored in column n, which for the longest one is the appended column; the padding after a
    sequence cannot change it (causal attention)."""
    tokens, _ = interleave(pairs, pad_id=pad_id)
    lengths = torch.tensor([len(example.ids) for pair in pairs for example in pair], dtype=torch.long)
    return F.pad(tokens, (0, 1), value=pad_id), lengths


def pair_loss(values: Tensor, mb: dict[str, Tensor], *, center_coef: float, pairs: int) -> tuple[Tensor, dict]:
    """`bradley_terry_loss` of one micro-batch's pairs as a contribution to the mean over the global batch's
    `pairs`. values: [b, T + 1], rows interleaved (chosen, rejected); mb["last"]: [b], the column of each
    row's score. Statistics are contributions to means over pairs: accuracy (a tie counts half), margin
    (chosen minus rejected score), scores/chosen and scores/rejected."""
    scores = values.gather(1, mb["last"][:, None]).squeeze(1)  # [b]
    losses, stats = bradley_terry_loss(scores[0::2], scores[1::2], center_coef=center_coef)
    loss = losses.sum() / pairs
    detached = scores.detach()
    return loss, {"loss": loss.detach(), "accuracy": stats["accuracy"].sum() / pairs,
                  "margin": stats["margin"].sum() / pairs, "scores/chosen": detached[0::2].sum() / pairs,
                  "scores/rejected": detached[1::2].sum() / pairs}


def pair_scores(model: TrainEngine, pairs: list[Pair], *, pad_id: int) -> Tensor:
    """Scores [2P] of the pairs' sequences (forward only), interleaved (chosen, rejected)."""
    tokens, last = score_inputs(pairs, pad_id=pad_id)
    values = model.values(tokens, micro_batch_size=tokens.shape[0])
    return values.gather(1, last[:, None]).squeeze(1)


def evaluate(run: RMRun) -> dict[str, float]:
    """Loss, accuracy and margin on the held-out pairs (forward only), means over all ranks' pairs."""
    pairs_per_chunk = run.cfg.train.micro_batch_size // 2
    n_pairs = group_sums([float(len(run.eval_pairs))], group=run.groups.dp)[0]
    totals = [0.0] * len(EVAL_KEYS)
    for i in range(0, len(run.eval_pairs), pairs_per_chunk):
        tokens, last = score_inputs(run.eval_pairs[i:i + pairs_per_chunk], pad_id=run.pad_id)
        values = run.model.values(tokens, micro_batch_size=tokens.shape[0])
        _, stats = pair_loss(values, {"last": last}, center_coef=run.cfg.rm.center_coef, pairs=n_pairs)
        totals = [t + float(stats[k]) for t, k in zip(totals, EVAL_KEYS)]
    return {f"eval/{k}": v for k, v in zip(EVAL_KEYS, group_sums(totals, group=run.groups.dp))}


# ---- the run -----------------------------------------------------------------------------------------------
def build_run(job: Job, groups: ParallelGroups) -> RMRun:
    """Tokenize the pairs (a malformed one stops here, before the model is built) and build the model."""
    from transformers import AutoTokenizer

    cfg = job.cfg
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    train_pairs, eval_pairs = encoded_pairs(cfg, tokenizer)
    return RMRun(cfg=cfg, groups=groups, model=build_engine(job, job.role("reward_model"), groups),
                 train_pairs=train_pairs, eval_pairs=eval_pairs[groups.dp_rank::groups.dp_size],
                 sampler=pair_sampler(cfg, groups, len(train_pairs)),
                 pairs_per_rank=cfg.data.prompts_per_step // groups.dp_size,  # they divide (megarl.layout)
                 pad_id=tokenizer.pad_token_id)


def train(cfg: Config) -> Path:
    """Run a reward-model recipe; returns the directory of the exported sequence classifier."""
    run = build_run(*launch(cfg))
    return train_on_pairs(cfg, run, step=rm_step, evaluate=evaluate, engines={"reward_model": run.model},
                          desc="rm", exported="reward_model")
