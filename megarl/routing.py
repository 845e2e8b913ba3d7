"""MoE routes: which experts each token was sent to, as the rollout engine recorded them.

A sample's routes are one integer tensor [tokens, moe_layers, top_k]: row t holds, for every MoE layer in
layer order, the top-k expert ids of token t's hidden state. They are stored in the smallest integer type
that holds every expert id (`route_dtype`) and only for real tokens, so a step's routes cost
`route_bytes_per_token` bytes per token of host memory. The trainer replays them (`algo.router_replay`,
megarl.engine.router_replay) and compares its own routing with them (`moe/routing_agreement`).

torch is imported where a tensor is made: `megarl plan` sizes routes without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

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


@dataclass(frozen=True)
class RouteUse:
    """What one pass of the trainer's schedule does with MoE routes."""

    routes: list[Tensor] | None = None  # [B] per sample [tokens - 1, moe_layers, top_k]: compared with the trainer's
    replay: bool = False                # route by `routes` instead of the trainer's own choice
    record: bool = False                # keep the trainer's own routing, per sample (TrainEngine.recorded_routes)


@dataclass(frozen=True)
class RoutePlan:
    """`algo.router_replay` resolved for a run: which routes each pass of the policy over a batch compares with
    (`moe/routing_agreement`, measured in the batch's first pass), replays or records.

    none: the trainer's own routing. r3: the rollout engine's (`engine_routes`) in every pass. r2: the old-logprob
    forward records its own and the training forwards replay it; an on-policy update has no separate old-logprob
    forward, and its one training forward is the routing r2 would replay."""

    mode: Literal["none", "r2", "r3"]
    on_policy: bool  # the training forward is the batch's first (AlgoConfig.on_policy)

    def old_logprobs(self, engine_routes: list[Tensor] | None) -> RouteUse:
        self._check(engine_routes)
        return RouteUse(routes=engine_routes, replay=self.mode == "r3", record=self.mode == "r2")

    def training(self, engine_routes: list[Tensor] | None, trainer_routes: list[Tensor] | None) -> RouteUse:
        self._check(engine_routes)
        if self.mode == "r3":
            return RouteUse(routes=engine_routes, replay=True)
        if self.mode == "r2" and not self.on_policy:
            return RouteUse(routes=trainer_routes, replay=True)
        return RouteUse(routes=engine_routes if self.on_policy else None)

    def _check(self, engine_routes: list[Tensor] | None) -> None:
        if self.mode == "r3" and engine_routes is None:
            raise RuntimeError("algo.router_replay = 'r3' but the rollout engine returned no routes for this batch")
