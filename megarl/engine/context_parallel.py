"""Sequences split over context-parallel ranks, the way Megatron's attention and rotary embedding expect.

Megatron's load-balanced split: a sequence of T positions (T a multiple of 2 * cp) is cut into 2 * cp
equal chunks and context-parallel rank r holds chunks r and 2 * cp - 1 - r, in that order. Under a causal
mask the early chunks attend to little and the late ones to much; pairing them gives every rank the same
attention work. Megatron's RotaryEmbedding slices its table the same way (`get_pos_emb_on_this_cp_rank`),
and Transformer Engine's attention assumes it.

`split_sequence` takes a rank's share of a [b, T] tensor, `gather_sequence` puts the shares of all ranks
back into [b, T] (differentiable), and `all_gather_keys_values` is the exchange the CPU attention
(megarl.engine.local_attention) makes: every rank's queries see the keys and values of the whole sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def cp_positions(seq_len: int, *, cp: int, rank: int, device=None) -> Tensor:
    """Positions [seq_len // cp] of the full sequence that context-parallel `rank` holds, in its order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def split_sequence(values: Tensor, *, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's share of `values` along `dim` (the sequence, [b, T] -> [b, T / cp] by default)."""
    if cp == 1:
        return values
    return values.index_select(dim, cp_positions(values.shape[dim], cp=cp, rank=rank, device=values.device))


class _GatherSequence(torch.autograd.Function):
    """[b, T / cp] on every rank of `group` -> [b, T] in sequence order. Backward: this rank's positions of
    the incoming gradient. That is right because every context-parallel rank computes the same function of
    the gathered tensor (the loss of the whole sequences), so each receives the same full gradient."""

    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        shares = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(shares, local.contiguous(), group=group)
        seq_len = local.shape[1] * cp
        full = local.new_empty(local.shape[0], seq_len, *local.shape[2:])
        for r, share in enumerate(shares):
            full[:, cp_positions(seq_len, cp=cp, rank=r, device=local.device)] = share
        ctx.positions = cp_positions(seq_len, cp=cp, rank=rank, device=local.device)
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[:, ctx.positions], None


def gather_sequence(local: Tensor, *, group) -> Tensor:
    """Per-token outputs of this rank's positions [b, T / cp, ...] -> the whole sequences [b, T, ...] on
    every rank of the context-parallel `group` (None: one rank, returned as is). Differentiable; see
    `_GatherSequence` for the contract its backward relies on."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherSequence.apply(local, group)


class _AllGatherKeysValues(torch.autograd.Function):
    """[s, ...] on every rank -> [cp * s, ...], rank 0's rows first. Backward: reduce-scatter, since every
    rank's queries used every rank's keys and values."""

    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        ctx.group = group
        shares = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shares, local.contiguous(), group=group)
        return torch.cat(shares)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shares = list(grad.contiguous().chunk(dist.get_world_size(ctx.group)))
        out = torch.empty_like(shares[0])
        dist.reduce_scatter(out, shares, group=ctx.group)
        return out, None


def all_gather_keys_values(key: Tensor, value: Tensor, *, group) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's keys and values [s, b, groups, dim] -> those of every context-parallel rank
    [cp * s, b, groups, dim] (rank order), and the sequence positions [cp * s] of those rows."""
    cp = dist.get_world_size(group)
    seq_len = key.shape[0] * cp
    positions = torch.cat([cp_positions(seq_len, cp=cp, rank=r, device=key.device) for r in range(cp)])
    return (_AllGatherKeysValues.apply(key, group), _AllGatherKeysValues.apply(value, group), positions)
