"""Where the rollout engines live: one on every group of `rollout.tp` consecutive ranks, whatever the trainer's
TP, PP, CP and EP, so every device generates (world / rollout.tp engines in all).

A data-parallel replica of the trainer (the ranks that hold one copy of the model: TP x CP x PP) and a
rollout group (the ranks one engine spans) need not nest: with pipeline stages a replica's ranks are not
consecutive. Ranks that are linked through either kind of group form one *exchange group*: its replicas'
prompts are pooled, split over its engines by prompt tokens, and every rank of the group receives what the
engines generated for its replica. In the common layouts an exchange group is one replica (TP innermost,
rollout.tp dividing TP x CP x PP); with pipeline stages and rollout.tp > 1 it can hold several replicas.

An SGLang engine larger than a node spans whole nodes (rollout.tp a multiple of the ranks per node): its host,
the group's first rank, runs SGLang's node 0 (the engine's requests, its schedulers there); the first rank of
each other node it spans starts SGLang's part on that node (`node_part`), whose schedulers take every request
from node 0 over SGLang's own TP group. Those ranks learn where node 0 meets them (`share_init_addr`) from the
host, over a group of their own (`node_heads`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.layout import engine_spans


@dataclass(frozen=True)
class RolloutPlacement:
    """This rank's view of the rollout engines of the job."""

    tp: int                          # ranks per engine (rollout.tp)
    engines: int                     # engines in the job: world size / tp
    engine_index: int | None         # this rank's engine (0 ... engines - 1); None when it hosts none
    exchange: dist.ProcessGroup | None  # the exchange group of this rank; None when it is this rank alone
    exchange_ranks: tuple[int, ...]  # its global ranks, ascending
    exchange_engines: tuple[int, ...]  # the global ranks in it that host an engine, ascending
    engine_group: dist.ProcessGroup | None = None  # the ranks this rank's engine spans, its host first; None: one
    engine_of: int = 0               # the engine whose group this rank belongs to (0 ... engines - 1)
    nodes: int = 1                   # nodes an engine spans (SGLang's nnodes): rollout.tp / ranks per node, or 1
    # On the first rank of node k >= 1 of an engine that spans nodes: k (it starts SGLang's part there); else None
    node_part: int | None = None
    # With nodes > 1, on an engine's host and its node parts: the group of those ranks, the host first
    node_heads: dist.ProcessGroup | None = None

    @property
    def hosts_engine(self) -> bool:
        return self.engine_index is not None


def place_rollout(*, rollout_tp: int, replica: dist.ProcessGroup, timeout: timedelta,
                  nodes: int = 1) -> RolloutPlacement:
    """The placement for engines of `rollout_tp` ranks each (the first rank of each group hosts the engine
    object; on GPU an SGLang engine spans the group's devices), each over `nodes` whole nodes (Layout.engine_nodes);
    `replica` is this rank's data-parallel replica (ParallelGroups.mp); `timeout`, how long a collective of the
    exchange groups waits. A collective call: every rank creates every group, in one order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    spans = engine_spans(range(world), rollout_tp)
    if len(spans[-1]) != rollout_tp:
        raise ValueError(f"rollout.tp = {rollout_tp} does not divide the world size {world}")
    replicas: list[tuple[int, ...] | None] = [None] * world
    dist.all_gather_object(replicas, tuple(dist.get_process_group_ranks(replica)))
    components = exchange_groups(replicas, rollout_tp=rollout_tp)
    mine = next(ranks for ranks in components if rank in ranks)
    exchange = engine_group = None
    for ranks in components:
        # every rank creates every group; one-rank groups need none
        if len(ranks) > 1:
            group = dist.new_group(list(ranks), timeout=timeout)
            if ranks == mine:
                exchange = group
    if rollout_tp > 1:
        for span in spans:
            group = dist.new_group(list(span), timeout=timeout)
            if rank in span:
                engine_group = group
    node_part = node_heads = None
    if nodes > 1:
        per_node = rollout_tp // nodes
        for span in spans:
            heads = list(span[::per_node])  # the host, then the first rank of each other node
            group = dist.new_group(heads, timeout=timeout)
            if rank in heads:
                node_heads = group
                node_part = heads.index(rank) or None
    hosts = [span.start for span in spans]
    return RolloutPlacement(tp=rollout_tp, engines=len(spans), engine_index=hosts.index(rank) if rank in hosts else None,
                            exchange=exchange, exchange_ranks=mine,
                            exchange_engines=tuple(r for r in mine if r in hosts), engine_group=engine_group,
                            engine_of=next(i for i, span in enumerate(spans) if rank in span), nodes=nodes,
                            node_part=node_part, node_heads=node_heads)


_ADDR_BYTES = 256


def share_init_addr(place: RolloutPlacement) -> str:
    """Where the nodes of this rank's engine meet (SGLang's dist_init_addr, "host:port"): the host picks an address
    of its node that the job's other nodes reach and a free port, and hands it to the engine's node parts over
    `node_heads` (a host tensor: gloo, no device communicator before SGLang sizes its memory). Called by the host
    and its node parts together, before each start of the engine."""
    text = torch.zeros(_ADDR_BYTES, dtype=torch.uint8)
    if place.hosts_engine:
        encoded = f"{reachable_address()}:{free_port()}".encode()
        text[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(text, group=place.node_heads, group_src=0)
    return bytes(text.tolist()).rstrip(b"\0").decode()


def reachable_address() -> str:
    """This node's address on the route to the job's rendezvous host (torchrun's MASTER_ADDR): the interface the
    other nodes reach it through (a hostname may resolve to a loopback address on the node itself)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # UDP: nothing is sent
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def free_port() -> int:
    """A TCP port free on this machine now (SGLang binds it moments later: a port taken in between fails the start,
    which the engine's restart answers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def exchange_groups(replicas: list[tuple[int, ...]], *, rollout_tp: int) -> list[tuple[int, ...]]:
    """The exchange groups of a job whose rank r belongs to replica `replicas[r]` (its ranks) and to the
    rollout group of `rollout_tp` consecutive ranks (megarl.layout.engine_spans): the sets of ranks linked
    through either kind of group (union-find), each ascending, in order of their first rank."""
    world = len(replicas)
    parent = list(range(world))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    linked = [list(ranks) for ranks in set(replicas)]
    linked += [list(span) for span in engine_spans(range(world), rollout_tp)]
    for members in linked:
        for other in members[1:]:
            parent[root(other)] = root(members[0])
    components: dict[int, list[int]] = {}
    for r in range(world):
        components.setdefault(root(r), []).append(r)
    return sorted(tuple(ranks) for ranks in components.values())
