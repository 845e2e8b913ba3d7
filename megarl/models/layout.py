"""Tensor surgery between HuggingFace and Megatron layouts: small pure functions, tested both ways.

Megatron fuses q, k and v into one `linear_qkv` weight grouped per query group: for each of the
`groups` KV heads, its `heads/groups` query heads, then its key head, then its value head. `linear_fc1`
of a gated MLP is [gate; up]. gpt-oss's HF experts are input-major (x @ W) and interleave gate and up
columns: gate_up_proj[e] is [h, 2*ffn] with gate at the even and up at the odd columns. Under tensor
parallelism every rank holds a contiguous run of whole query groups of linear_qkv, but [gate_r; up_r] of
linear_fc1: the two halves are split separately.
"""

from __future__ import annotations

import torch
from torch import Tensor


def join_qkv(q: Tensor, k: Tensor, v: Tensor, *, groups: int, head_dim: int) -> Tensor:
    """q [heads*hd, ...], k [groups*hd, ...], v [groups*hd, ...] -> [groups*(heads/groups + 2)*hd, ...]."""
    rest = q.shape[1:]
    q = q.reshape(groups, -1, head_dim, *rest)
    k = k.reshape(groups, 1, head_dim, *rest)
    v = v.reshape(groups, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, *, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `join_qkv`."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, -1, head_dim, *rest)
    per_group = grouped.shape[1] - 2
    q, k, v = torch.split(grouped, [per_group, 1, 1], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def join_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """gate [ffn, h], up [ffn, h] -> fc1 [2*ffn, h]."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of `join_gate_up`."""
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def interleaved_to_fc1(gate_up: Tensor) -> Tensor:
    """One gpt-oss expert's gate_up_proj [h, 2*ffn] (gate, up alternating) or its bias [2*ffn] -> linear_fc1's
    weight [2*ffn, h] ([gate; up]) or bias [2*ffn]."""
    return torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).t().contiguous()


def fc1_to_interleaved(fc1: Tensor) -> Tensor:
    """Inverse of `interleaved_to_fc1`."""
    gate, up = fc1.t().chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def down_to_fc2(down: Tensor) -> Tensor:
    """One gpt-oss expert's down_proj [ffn, h] -> linear_fc2's weight [h, ffn]."""
    return down.t().contiguous()


def fc2_to_down(fc2: Tensor) -> Tensor:
    """Inverse of `down_to_fc2`."""
    return fc2.t().contiguous()


def shard(full: Tensor, *, dim: int | None, rank: int, size: int, gate_up: bool = False) -> Tensor:
    """This TP rank's slice of a full tensor; dim None = replicated. gate_up splits each half separately."""
    if dim is None or size == 1:
        return full
    if gate_up:
        return torch.cat([half.chunk(size, dim=dim)[rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(size, dim=dim)[rank].contiguous()


def unshard(shards: list[Tensor], *, dim: int | None, gate_up: bool = False) -> Tensor:
    """Inverse of `shard` over the list of every rank's slice, in rank order."""
    if dim is None or len(shards) == 1:
        return shards[0]
    if gate_up:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], dim=dim), torch.cat([h[1] for h in halves], dim=dim)])
    return torch.cat(shards, dim=dim)
