"""MoE routing in the trainer: compare it with the rollout engine's, replay the engine's (R3) or the old-logprob
forward's (R2), per token, through megatron-core's router-replay hook.

megatron-core's TopKRouter hands its top-k choice to `router.router_replay.get_replay_topk(scores, topk, ...,
default_compute_topk)` when that attribute is set (megatron.core.transformer.moe.router_replay). Its own
RouterReplay keeps every instance of the process in one class-wide list, which would mix the actor's routers
with the reference model's; megarl sets its own `LayerRouting` on the actor's routers instead and gives each
layer its tokens' experts itself, micro-batch by micro-batch.

Token order. A router sees the hidden states of its micro-batch as [s, b] flattened, s major: the sequence
split over context-parallel ranks (megarl.engine.context_parallel) and, with sequence parallelism, cut into
tensor-parallel chunks; a packed micro-batch is one row of its sequences back to back. `padded_routes` and
`packed_routes` put samples' routes [tokens, layers, top_k] into that order, `recorded_micro_batch` takes
recorded ones back out.
Positions without a route (the last token, which the engine never fed in; padding) keep the trainer's own
choice: their outputs are no logprob of any token.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.device import current_device
from megarl.engine.context_parallel import gather_sequence, split_sequence
from megarl.packing import PackedRow, sequence_positions
from megarl.routing import RouteUse


class LayerRouting:
    """The router-replay hook of one MoE layer (megatron-core calls `get_replay_topk`).

    With activation recompute the layer routes again in the backward pass, after later micro-batches' forwards
    (pipeline schedules interleave them): each training forward then queues its target, and a recomputation,
    recognized by running inside autograd's backward, takes the oldest. Backward passes come in forward order
    per model chunk in every Megatron schedule, and each layer belongs to one chunk."""

    def __init__(self, layer: int, *, recompute: bool):
        self.layer = layer                   # index among the model's MoE layers
        self.target: Tensor | None = None    # [tokens, top_k] long for the current micro-batch; rows < 0: none
        self.recompute = recompute
        self.queued: deque[Tensor | None] = deque()  # targets of forwards whose backward will route again
        self.replay = False
        self.recorded: list[Tensor] | None = None  # own choices, one [tokens, top_k] per micro-batch
        # choices equal to the target's, over rows that have one; device tensors, so no router call waits on a
        # copy to the host
        self.matched: Tensor | int = 0
        self.compared: Tensor | int = 0

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[Tensor, Tensor]:
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if torch._C._current_graph_task_id() != -1:  # recomputed in the backward pass: as the forward routed
            target = self.queued.popleft() if self.queued else None
            return self._route(scores, own, probs, target)
        if self.recompute:  # (a checkpointed forward runs without grad: queue whatever the mode)
            self.queued.append(self.target)
        if self.recorded is not None:
            self.recorded.append(own.detach())
        target = self.target
        if target is None:
            return probs, own
        if target.shape != own.shape:
            raise ValueError(f"MoE layer {self.layer}: routes for {tuple(target.shape)} tokens x experts, the router "
                             f"chose for {tuple(own.shape)}; the routes do not follow this micro-batch's tokens")
        known = target[:, 0] >= 0
        with torch.no_grad():
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, own, True)
            hits = chosen.gather(1, target.clamp(min=0)).sum(1)
            self.matched = self.matched + hits[known].sum()
            self.compared = self.compared + known.sum() * topk
        return self._route(scores, own, probs, target)

    def _route(self, scores: Tensor, own: Tensor, probs: Tensor, target: Tensor | None) -> tuple[Tensor, Tensor]:
        if not self.replay or target is None:
            return probs, own
        chosen_ids = torch.where((target[:, 0] >= 0)[:, None], target, own)
        # the probabilities of the replayed experts stay differentiable in the router's scores, as its own are
        return scores.gather(1, chosen_ids), chosen_ids


class ModelRouting:
    """The LayerRouting hooks of one engine's model chunks, installed on every TopKRouter."""

    def __init__(self, chunks: list, *, moe_layers: int, sequence_parallel: bool, groups, first_moe_layer: int = 0):
        from megatron.core.transformer.moe.router import TopKRouter

        self.chunks = []  # per chunk: its LayerRouting hooks
        for chunk in chunks:
            hooks = []
            for module in chunk.modules():
                # the fused top-k kernel (moe_router_fusion) never calls the hook: no replay, no agreement
                if isinstance(module, TopKRouter) and not module.config.moe_router_fusion:
                    # routes hold the MoE layers only: dense first layers (first_moe_layer of them) have none
                    module.router_replay = LayerRouting(module.layer_number - 1 - first_moe_layer,
                                                        recompute=module.config.recompute_granularity is not None)
                    hooks.append(module.router_replay)
            self.chunks.append(hooks)
        self.moe_layers = moe_layers
        # sequence parallelism splits a micro-batch's tokens over the TP ranks (a one-rank TP group splits nothing)
        self.splits_over_tp = sequence_parallel and groups.tp_size > 1
        self.groups = groups
        self.matched, self.compared = 0, 0
        self.recorded: list[Tensor] | None = None  # per sample, after a pass with RouteUse.record

    @property
    def hooks(self) -> list[LayerRouting]:
        return [hook for hooks in self.chunks for hook in hooks]

    def begin(self, use: RouteUse) -> None:
        for hook in self.hooks:
            hook.replay = use.replay
            hook.recorded = [] if use.record else None
            hook.target = None
            hook.queued.clear()

    def set_micro_batch(self, chunk: int, routes: Tensor | None) -> None:
        """Targets for the next forward of `chunk`: local routes [tokens, moe_layers, top_k] (or None)."""
        for hook in self.chunks[chunk]:
            hook.target = None if routes is None else routes[:, hook.layer]

    def end(self) -> None:
        for hook in self.hooks:
            self.matched += int(hook.matched)
            self.compared += int(hook.compared)
            hook.matched = hook.compared = 0
            hook.target = None
            hook.queued.clear()

    def combine_stages(self, recorded: list[Tensor]) -> list[Tensor]:
        """Per-sample routing with -1 in other pipeline stages' layers -> every layer's, on every stage."""
        if self.groups.pp_size == 1:
            return recorded
        flat = torch.cat([r.reshape(-1) for r in recorded]).to(current_device())
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.groups.pp)
        return [f.view_as(r) for f, r in zip(flat.cpu().split([r.numel() for r in recorded]), recorded)]

    def take_agreement(self) -> float | None:
        """The fraction of (token, layer) expert choices of the trainer's own routing that the rollout engine
        made too, over the forwards since the last call and every rank; None when nothing was compared."""
        counts = torch.tensor([self.matched, self.compared], dtype=torch.float64, device=current_device())
        self.matched, self.compared = 0, 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        counts = counts.cpu()
        return float(counts[0] / counts[1]) if counts[1] > 0 else None

    # ---- token order ------------------------------------------------------------------------------------
    def _local(self, rows: Tensor) -> Tensor:
        """[b, s, L, K] rows of a micro-batch -> [tokens, L, K] in the router's order on this rank."""
        rows = split_sequence(rows, cp=self.groups.cp_size, rank=self.groups.cp_rank)
        seq_major = rows.transpose(0, 1)
        if self.splits_over_tp:
            seq_major = seq_major.chunk(self.groups.tp_size, dim=0)[self.groups.tp_rank]
        return seq_major.reshape(-1, *seq_major.shape[2:])

    def padded_routes(self, routes: list[Tensor], index: Tensor, *, width: int, device) -> Tensor:
        """Local routes of padded micro-batch rows `index`, `width` columns."""
        dense = _dense([routes[i] for i in index.tolist()], width=width, layers=self.moe_layers)
        return self._local(dense).to(device)

    def packed_routes(self, routes: list[Tensor], row: PackedRow, *, device) -> Tensor:
        """Local routes of a packed row: each sequence's routes at its tokens' positions, one column per token (a
        shared row's prompt once: megarl.packing.with_prompt_routes shares it only among equal routes)."""
        out = torch.full((row.row_len, self.moe_layers, _top_k(routes)), -1, dtype=torch.long)
        for i, where in zip(row.index.tolist(), sequence_positions(row)):
            r = routes[i][: len(where)]
            out[where[: len(r)]] = r.long()  # a shared prompt's: its samples' routes over it are equal
        return self._local(out[None]).to(device)

    # ---- recorded routing back to samples (r2) ----------------------------------------------------------
    def recorded_micro_batch(self, m: int, *, rows: int) -> Tensor:
        """The own routing of micro-batch `m`'s forward, [rows, whole sequence, L, K] in sample order (-1 in
        the layers of other pipeline stages), gathered over tensor- and context-parallel ranks."""
        first = self.hooks[0].recorded[m]
        out = torch.full((first.shape[0], self.moe_layers, first.shape[1]), -1, dtype=torch.long, device=first.device)
        for hook in self.hooks:
            out[:, hook.layer] = hook.recorded[m]
        seq_major = out.view(-1, rows, *out.shape[1:])
        if self.splits_over_tp:
            shares = [torch.empty_like(seq_major) for _ in range(self.groups.tp_size)]
            dist.all_gather(shares, seq_major.contiguous(), group=self.groups.tp)
            seq_major = torch.cat(shares)
        return gather_sequence(seq_major.transpose(0, 1).contiguous(), group=self.groups.cp)


def _top_k(routes: list[Tensor]) -> int:
    return routes[0].shape[-1]


def _dense(routes: list[Tensor], *, width: int, layers: int) -> Tensor:
    """Per-sample routes -> [b, width, layers, top_k] long, -1 where a position has none."""
    out = torch.full((len(routes), width, layers, _top_k(routes)), -1, dtype=torch.long)
    for j, r in enumerate(routes):
        r = r[:width]
        out[j, : len(r)] = r.long()
    return out
