"""The supervised step: masked NLL of the trained tokens, token mean over the global batch.

One optimizer step of supervised fine-tuning, shared by the SFT loop (`megarl.loops.sft`) and the RL loop's
supervised warm start, so both train with the same loss, normalization and micro-batching.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from megarl.algo.aggregate import LossNorm, aggregate, global_loss_norm
from megarl.algo.losses import sft_loss
from megarl.data.supervised import Example, pad_examples


def supervised_loss(logprobs: Tensor, mb: dict[str, Tensor], *, norm: LossNorm) -> tuple[Tensor, dict]:
    """Masked NLL of one micro-batch as a contribution to the global token mean (denominator: trained
    tokens of the whole global batch). Also reports `response_prob`, the mean over sequences of
    p(every trained token) at temperature 1: for a one-answer row, the exact-answer reward sampling would earn.
    logprobs, mb["response_mask"]: [b, T]."""
    mask = mb["response_mask"]
    loss = aggregate(sft_loss(logprobs, mask), mask, mode="token-mean", norm=norm)
    response_prob = (logprobs.detach() * mask).sum(-1).exp().sum() / norm.seqs
    return loss, {"loss": loss.detach(), "response_prob": response_prob}


def supervised_step(engine, examples: list[Example], *, pad_id: int, group, micro_batch_size: int,
                    micro_batch_tokens: int | None = None) -> dict[str, float]:
    """One optimizer step of `engine` on this rank's `examples` of the global batch.

    group: the data-parallel group, over which the token count of the mean is taken. `micro_batch_tokens`:
    sequence packing (rows of at most that many tokens, no padding) instead of `micro_batch_size` padded rows;
    the same loss and gradients. Returns the engine's metrics: `loss` and `response_prob` over the global
    batch, `grad_norm`.
    """
    tokens, mask = pad_examples(examples, pad_id=pad_id)
    loss_fn = partial(supervised_loss, norm=global_loss_norm(mask, group=group))
    return engine.train_step(tokens, {"response_mask": mask}, loss_fn, temperature=1.0,
                             micro_batch_size=micro_batch_size, **packing(examples, micro_batch_tokens))


def packing(examples: list[Example], micro_batch_tokens: int | None) -> dict:
    """The engine's packing arguments for `examples` (none without `micro_batch_tokens`)."""
    if not micro_batch_tokens:
        return {}
    return {"micro_batch_tokens": micro_batch_tokens,
            "lengths": torch.tensor([len(e.ids) for e in examples], dtype=torch.long)}
