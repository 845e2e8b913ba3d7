"""Loss aggregation over tokens and sequences, normalized by global-batch counts.

A global batch is split over DP ranks and, on each rank, over micro-batches. `aggregate` returns one
micro-batch's contribution to the global-batch loss; every denominator is a count over the whole global batch
(`LossNorm`), so summing the contributions of all micro-batches on all ranks gives exactly the loss one
process would compute on the concatenated batch, whatever the split.

Masks are `[B, T]` over response tokens; any nonzero entry counts as a valid token.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossNorm:
    """Counts over the whole global batch (all DP ranks, all micro-batches), the denominators of `aggregate`."""

    tokens: float
    """Number of valid (mask != 0) tokens."""
    seqs: float
    """Number of sequences with at least one valid token; empty sequences neither count nor contribute."""
    max_len: int
    """Padded response length T (the largest over the group): the constant divisor of Dr. GRPO's
    seq-mean-token-sum-norm. A caller who wants the generation budget instead builds LossNorm directly."""


def masked_sum(values: Tensor, mask: Tensor, *, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is nonzero.

    values, mask: same shape, e.g. `[B, T]`. Returns a scalar (dim=None) or the sum over `dim`.
    Masked entries are selected out rather than multiplied by 0, so a NaN/inf in padding cannot leak in.
    """
    selected = torch.where(mask.bool(), values, 0.0)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, *, dim: int | None = None, group=None) -> Tensor:
    """Mean of `values` over the entries where `mask` is nonzero.

    values, mask: same shape, e.g. `[B, T]`.
    dim=None: scalar mean; denominator = number of valid entries (over all ranks of `group` when given).
    dim=d: mean along d, denominator = valid entries along d; a slice with none gives 0, not NaN.
    group: when given, sums and counts are all-reduced, so every rank gets the mean over the concatenation of
    all ranks' inputs. The collective is not differentiable: the result is detached (a statistic).
    """
    if group is not None and dim is not None:
        raise ValueError("masked_mean: group= reduces over all entries; it cannot be combined with dim=")
    total = masked_sum(values, mask, dim=dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    if group is not None:
        # one all_reduce for both numbers; float64 keeps token counts exact past 2**24
        totals = torch.stack([total.detach().double(), count.double()])
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        total, count = totals[0].to(values.dtype), totals[1]
    return total / count.clamp(min=1).to(total.dtype)


def group_sums(values: list[float], *, group) -> list[float]:
    """Element-wise sums of `values` over the ranks of `group`, in one all-reduce (float64, so token counts
    stay exact past 2**24); `values` itself when the group has one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    totals = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    return totals.tolist()


def global_loss_norm(mask: Tensor, *, group=None) -> LossNorm:
    """Counts of the global batch from this rank's full mini-batch mask.

    mask: `[B, T]` response mask of ALL micro-batches this rank will process in the step.
    group: DP process group; sums `tokens` and `seqs` and takes the max of T over it. None: this rank only.
    Returns LossNorm(tokens=valid tokens, seqs=sequences with >= 1 valid token, max_len=padded T).
    """
    valid = mask.bool()
    counts = torch.stack([valid.sum(), valid.any(dim=-1).sum()]).double()
    max_len = torch.tensor([mask.shape[-1]], dtype=torch.int64, device=mask.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(max_len, op=dist.ReduceOp.MAX, group=group)
    return LossNorm(tokens=counts[0].item(), seqs=counts[1].item(), max_len=int(max_len.item()))


def aggregate(values: Tensor, mask: Tensor, *, mode: str, norm: LossNorm) -> Tensor:
    """This micro-batch's contribution to the global-batch loss (a scalar).

    values: `[B, T]` per-token loss; mask: `[B, T]`; norm: counts of the global batch (`global_loss_norm`).
    Modes, with L_i = sum over valid tokens of sequence i and n_i its valid-token count:
      "token-mean":              sum_i L_i / norm.tokens                     (DAPO, Yu et al. 2025)
      "seq-mean-token-sum":      sum_i L_i / norm.seqs
      "seq-mean-token-mean":     sum_i (L_i / n_i) / norm.seqs               (GRPO, Shao et al. 2024)
      "seq-mean-token-sum-norm": sum_i L_i / (norm.seqs * norm.max_len)      (Dr. GRPO, Liu et al. 2025)
    A sequence with n_i = 0 contributes 0. Denominators are clamped to >= 1 so an all-empty batch gives 0.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGGREGATION_MODES)}")
    seqs = max(norm.seqs, 1.0)
    if mode == "token-mean":
        return masked_sum(values, mask) / max(norm.tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked_sum(values, mask) / seqs
    if mode == "seq-mean-token-mean":
        return masked_mean(values, mask, dim=-1).sum() / seqs
    return masked_sum(values, mask) / (seqs * max(norm.max_len, 1))
