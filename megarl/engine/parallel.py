"""Process groups: Megatron's parallel state, started once and handed to the rest of megarl as explicit groups.

This module and the train engine's are the only ones that read Megatron's global `parallel_state`;
everything else receives a `ParallelGroups`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.device import load_cuda_driver_stand_in, on_gpu


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups and ranks handed to the rest of megarl (None group = a size-1 axis)."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    mp: dist.ProcessGroup          # tensor x context x pipeline: the ranks of one data-parallel replica
    ep: dist.ProcessGroup          # expert parallel: the ranks that split one layer's experts between them
    etp: dist.ProcessGroup         # expert tensor parallel: the ranks that split each routed expert's linears
    cp: dist.ProcessGroup          # context parallel: the ranks that split every sequence between them
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    etp_rank: int
    etp_size: int
    cp_rank: int
    cp_size: int
    pp_last_global_rank: int       # global rank of the last pipeline stage of this rank's pipeline
    mp_src_global_rank: int        # global rank of this replica's first rank (the one that writes its sampler state)
    timeout: timedelta             # how long a collective of any group waits (parallel.timeout_minutes)

    @property
    def is_pp_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def world_backend(cuda: bool) -> str:
    """torch.distributed's backends for the world, which every group made later inherits (Megatron's and
    megarl's alike). On a GPU, NCCL serves CUDA tensors only (torch's `Backend.backend_capability`), while
    the loops' bookkeeping (counts, sums, flags, objects) is host tensors: gloo serves those on every group,
    NCCL the device tensors. On CPU, gloo serves everything."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_parallel(*, tp: int, pp: int, ep: int = 1, etp: int | None = None, cp: int = 1, seed: int = 0,
                  timeout: timedelta = timedelta(minutes=60),
                  trainer_store: tuple[dist.Store, int, int] | None = None) -> ParallelGroups:
    """Initialize torch.distributed (torchrun env, else a one-process group) and Megatron's parallel state.
    `etp`: the expert tensor-parallel size (parallel.etp; None: tp, Megatron's default).
    Every process group waits `timeout` in a collective before it fails (parallel.timeout_minutes).
    `trainer_store` (store, rank, world size): the world meets through that store instead of torchrun's env://
    (megarl.loops.launch.start_parallel: keys of this start's own; placement split: the training ranks of a
    larger job)."""
    cuda = on_gpu()
    if not cuda:
        load_cuda_driver_stand_in()  # before megatron's imports, which may load CUDA kernels
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        if trainer_store is not None or "RANK" in os.environ:
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            meet = {}  # torchrun's env:// rendezvous
            if trainer_store is not None:
                meet = dict(zip(("store", "rank", "world_size"), trainer_store))
            dist.init_process_group(world_backend(cuda), timeout=timeout, **meet)
        else:  # one process outside torchrun
            dist.init_process_group(world_backend(cuda), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    from megarl.engine import cpu_compat

    if not cuda:
        cpu_compat.install()
    cpu_compat.patch_moe_router_without_te()  # a GPU machine may lack Transformer Engine too
    cpu_compat.patch_mla_without_te()
    cpu_compat.patch_optimizer_config_without_te()
    world = dist.get_world_size()
    etp = tp if etp is None else etp
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    if world % (etp * ep * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp,
                                     distributed_timeout_minutes=timeout.total_seconds() / 60)
    current = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size(),
               ps.get_context_parallel_world_size())
    if current != (tp, pp, ep, etp, cp):
        raise RuntimeError(f"Megatron's parallel state is already initialized with tp, pp, ep, etp, cp = "
                           f"{current}, not the requested {(tp, pp, ep, etp, cp)}")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    replica = ps.get_model_parallel_group()
    if cp > 1:
        # Megatron's model-parallel group (tensor x pipeline) leaves context parallelism out, its ranks hold
        # the same weights; but context-parallel ranks also share one rollout batch and one rollout engine,
        # so `mp` here is the whole replica: the ranks of one data-parallel index. Every rank creates every
        # group, in the same order.
        dp_of_rank: list[int | None] = [None] * world
        dist.all_gather_object(dp_of_rank, ps.get_data_parallel_rank())
        for index in sorted(set(dp_of_rank)):
            group = dist.new_group([r for r, d in enumerate(dp_of_rank) if d == index], timeout=timeout)
            if index == ps.get_data_parallel_rank():
                replica = group
    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(), mp=replica,
        ep=ps.get_expert_model_parallel_group(), etp=ps.get_expert_tensor_parallel_group(),
        cp=ps.get_context_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep,
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=etp,
        cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
        pp_last_global_rank=pp_ranks[-1], mp_src_global_rank=min(dist.get_process_group_ranks(replica)),
        timeout=timeout,
    )
