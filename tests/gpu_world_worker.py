"""A torchrun rank whose world has the backends a GPU run would have, emulated on the CPU: every backend
entry keeps its devices, and NCCL becomes gloo on the devices NCCL serves only (torch's
`Backend.backend_capability`: CUDA), so the world refuses host tensors where a GPU world's NCCL would.
megarl's `init_parallel` keeps a world that exists.

    python -m torch.distributed.run --nproc_per_node=2 tests/gpu_world_worker.py BACKEND sums
    python -m torch.distributed.run --nproc_per_node=2 tests/gpu_world_worker.py BACKEND train RECIPE [key=value ...]

BACKEND: a torch.distributed backend string, or `megarl` for the one megarl starts a GPU world with.
`sums` all-reduces the loops' host-side counts (megarl.algo.aggregate.group_sums) over the world and prints them,
or what refused them. `nodes` places one rollout engine over the two ranks as if each were a node of its own
(megarl.rollout.placement) and prints where each rank learns the engine's nodes meet.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist


def on_ncclls_devices(backend: str) -> str:
    """`backend` with NCCL replaced by gloo restricted to NCCL's devices: "nccl" -> "cuda:gloo",
    "cpu:gloo,cuda:nccl" -> "cpu:gloo,cuda:gloo"."""
    entries = []
    for entry in backend.split(","):
        device, _, name = entry.rpartition(":")
        devices = [device] if device else dist.Backend.backend_capability[name]
        entries += [f"{d}:{'gloo' if name == 'nccl' else name}" for d in devices]
    return ",".join(entries)


def say(line: str) -> None:
    """One line in one write: the ranks share a pipe, and print's separate writes of its parts interleave."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    from megarl.engine.parallel import world_backend

    backend, command = argv[0], argv[1]
    dist.init_process_group(on_ncclls_devices(world_backend(True) if backend == "megarl" else backend))
    if command == "sums":
        from megarl.algo.aggregate import group_sums

        try:
            say(f"sums {group_sums([1.0, float(dist.get_rank())], group=dist.group.WORLD)}")
        except RuntimeError as e:
            say(f"refused: {e}")
            # every rank says so before any exits: torchrun ends the other ranks once one has failed, and a
            # loaded machine may not have brought the other to its collective yet (the store needs no backend)
            store = dist.distributed_c10d._get_default_store()
            store.add("refused", 1)
            while store.add("refused", 0) < dist.get_world_size():
                time.sleep(0.05)
            os._exit(3)  # at once: a world torn down after a failed collective may abort instead of exiting
        dist.destroy_process_group()  # gloo's threads joined before exit: left to the interpreter, a rank may abort
        return
    if command == "nodes":
        from datetime import timedelta

        from megarl.rollout.placement import place_rollout, share_init_addr

        replicas = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
        place = place_rollout(rollout_tp=2, replica=replicas[dist.get_rank()], timeout=timedelta(minutes=1), nodes=2)
        say(f"rank {dist.get_rank()} node part {place.node_part} meets at {share_init_addr(place)}")
        dist.destroy_process_group()
        return
    from megarl.cli import main as megarl_main

    megarl_main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
