"""What crosses between megarl and SGLang besides requests (megarl.rollout.sglang_engine describes the engine):
a weight push's buckets, flattened on each rank of the engine's group and serialized for the SGLang TP rank on
that rank's device (`gather_payloads`; the trainer ranks beside the engine's host run `SGLangPeer`), and the MoE
routes SGLang returns with each response (`decode_routes`).
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.device import current_device, host_barrier, on_gpu
from megarl.handoff import buckets, flatten
from megarl.routing import compact


class SGLangPeer:
    """A trainer rank beside an SGLang engine's host, on one of the engine's devices (colocated placement): in
    every push it hands the SGLang TP rank on its device that rank's payload of each bucket."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        if on_gpu():
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()  # as the host: CUDA IPC handles name the GPU by UUID
        # A host tensor's default handle is a file descriptor handed over by this process to the processes of
        # its own job only (same authentication key); the scheduler that opens it is the host's child.
        torch.multiprocessing.set_sharing_strategy("file_system")

    def push(self, named_tensors: Iterable[tuple[str, Tensor]], *, bucket_bytes: int) -> dict:
        """This rank's side of `SGLangEngine.update_weights`, bucket by bucket; returns the push's counts."""
        nbytes, held = 0, None
        with ipc_exportable(on_gpu()):
            for bucket in buckets(named_tensors, bucket_bytes=bucket_bytes):
                _, held, _ = gather_payloads(bucket, group=self.group)  # the previous bucket's copy is loaded
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            host_barrier(self.group)  # the host loaded the last bucket: the buffers may go
        del held
        if on_gpu():
            torch.cuda.ipc_collect()  # the staging buffers of the buckets the schedulers released
        return {"bytes": nbytes}


def gather_payloads(bucket: list[tuple[str, Tensor]], *,
                    group: dist.ProcessGroup) -> tuple[list[bytes] | None, Tensor, list]:
    """Every rank of an engine's `group` flattens `bucket` on its own device (megarl.handoff.flatten: the same
    slots on every rank) and serializes the buffer for the SGLang TP rank there; returns the payloads, in group
    order (= TP rank order), on the group's first rank (the host), None elsewhere, this rank's buffer, to be kept
    until the host has loaded it (until the next gather, which the host joins once SGLang took the bucket, or the
    push's closing `host_barrier`; at most two buckets per rank are in flight), and its slots."""
    from sglang.srt.utils import MultiprocessingSerializer

    flat, slots = flatten(bucket, device=current_device(), share_memory=True)
    payload = MultiprocessingSerializer.serialize(flat)
    gathered = [None] * group.size() if dist.get_rank(group) == 0 else None
    dist.gather_object(payload, gathered, group=group, group_dst=0)
    return gathered, flat, slots


def decode_routes(encoded: str | None, *, tokens: int, layers: int, top_k: int, experts: int) -> Tensor:
    """SGLang's `meta_info["routed_experts"]` (base64 of int32 [rows, layers, top_k], row t for the t-th
    token fed in) as the first `tokens` rows, [tokens, layers, top_k] in `route_dtype(experts)`.

    Rows past `tokens` are cut (the contract ends at the last token fed in); fewer rows, a size that is
    not whole rows, or an id outside 0 .. experts - 1 is an error: a route that is not the engine's own
    must never reach the trainer.
    """
    if encoded is None:
        raise RuntimeError("SGLang returned no routed_experts: was the engine started with capture_routes?")
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
    if flat.numel() % (layers * top_k):
        raise RuntimeError(f"SGLang returned {flat.numel()} expert ids, not whole rows of {layers} layers x "
                           f"top-{top_k}")
    rows = flat.view(-1, layers, top_k)
    if rows.shape[0] < tokens:
        raise RuntimeError(f"SGLang returned routes for {rows.shape[0]} tokens; the prompt and response fed "
                           f"in {tokens}")
    rows = rows[:tokens]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= experts):
        raise RuntimeError(f"SGLang returned expert ids in [{int(rows.min())}, {int(rows.max())}], outside the "
                           f"model's {experts} experts")
    return compact(rows, experts)


@contextlib.contextmanager
def ipc_exportable(on_gpu: bool) -> Iterator[None]:
    """Stage buckets in plain caching-allocator blocks: memory from expandable segments cannot be exported
    through legacy CUDA IPC (pidfd_getfd fails in the receiver)."""
    expandable = on_gpu and "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
    if expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if expandable:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
