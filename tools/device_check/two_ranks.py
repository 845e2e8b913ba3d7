"""`megarl train` on two ranks that share one GPU, for the device check (stage two_ranks of check.py):

    torchrun --standalone --nproc_per_node=2 tools/device_check/two_ranks.py train RECIPE [key.path=value ...]

NCCL refuses two ranks on one device, so this script starts the world itself before megarl does
(megarl.engine.parallel.init_parallel keeps a world that exists): the world megarl builds on a GPU
(`world_backend`), with gloo standing in for NCCL on its CUDA side. Device tensors are then still reduced as
CUDA tensors and host tensors on the cpu side, as in a run over several GPUs. Without CUDA (the dry run) both
ranks run on the CPU with gloo. Each rank prints one line with its rank, backend and device, for the check.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megarl.engine.parallel import world_backend


def allreduce_coalesced_flat(group: dist.ProcessGroup, tensors: list[torch.Tensor],
                             opts: dist.AllreduceCoalescedOptions) -> dist.Work:
    """ProcessGroup.allreduce_coalesced as one all-reduce of a flat copy of `tensors` (same dtype and
    device), written back in place; the returned work is complete. gloo coalesces host tensors only, and
    Megatron's gradient sync coalesces its buckets' CUDA gradients (torch's _coalescing_manager), which NCCL
    does and gloo refuses."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    one = dist.AllreduceOptions()
    one.reduceOp = opts.reduceOp
    work = group.allreduce([flat], one)
    work.wait()
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))
    return work


def main(argv: list[str]) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)  # both ranks: the machine has one GPU
        dist.ProcessGroup.allreduce_coalesced = allreduce_coalesced_flat
    backend = world_backend(cuda).replace("nccl", "gloo")
    dist.init_process_group(backend)  # torchrun's env:// rendezvous
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    print(f"two_ranks: rank {dist.get_rank()} of {dist.get_world_size()}, local rank "
          f"{os.environ.get('LOCAL_RANK')}, backend {backend}, device {device}", flush=True)

    from megarl.cli import main as megarl_main

    megarl_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
