"""MoE routes: which experts each token was sent to, as the rollout engine recorded them.

A sample's routes are one integer tensor [tokens, moe_layers, top_k]: row t holds, for every MoE layer in
layer order, the top-k expert ids of token t's hidden state. They are stored in the smallest integer type
that holds every expert id (`route_dtype`) and only for real tokens, so a step's routes cost
`route_bytes_per_token` bytes per token of host memory. The trainer replays them (`algo.router_replay`,
megarl.engine.router_replay) and compares its own routing with them (`moe/routing_agreement`).

torch is imported where a tensor is made: `megarl plan` sizes routes without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import Tensor


def route_id_bytes(experts: int) -> int:
    """Bytes of one expert id in `route_dtype(experts)`: the fewest that hold ids 0 .. experts - 1."""
    if experts <= 256:
        return 1
    if experts <= 2**15:
        return 2
    return 4


def route_dtype(experts: int) -> torch.dtype:
    """The smallest integer type that holds expert ids 0 .. experts - 1."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[route_id_bytes(experts)]


def compact(routes: Tensor, experts: int) -> Tensor:
    """`routes` (any integer type) in `route_dtype(experts)`, on the host."""
    return routes.to("cpu", route_dtype(experts))


def route_bytes_per_token(*, moe_layers: int, top_k: int, experts: int) -> int:
    """Host memory of one token's routes."""
    return moe_layers * top_k * route_id_bytes(experts)
