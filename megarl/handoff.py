"""Weight handoff from the trainer to a rollout engine: full HF tensors in byte-bounded buckets.

The trainer yields full HF-named tensors one at a time (TP shards gathered, pipeline stages relayed);
`buckets` groups them into lists of at most `bucket_bytes` (a larger tensor travels alone), and
`push_weights` hands those to the engine under a version number. Everything is a generator, so peak
extra memory is about one bucket plus the largest tensor, whatever the model size. Where a bucket crosses a
process as one byte buffer (SGLang's flattened bucket, the broadcast to split placement's rollout ranks),
`flatten` packs it and `unflatten` reads the tensors back as views of the buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def buckets(named_tensors: Iterable[tuple[str, Tensor]], *, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group (name, tensor) pairs in order into lists whose total size stays within `bucket_bytes`."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# (name, shape, dtype, first byte, end byte) of a tensor in a flattened bucket
Slot = tuple[str, torch.Size, torch.dtype, int, int]


def flatten(bucket: list[tuple[str, Tensor]], *, device: torch.device | None = None,
            share_memory: bool = False) -> tuple[Tensor, list[Slot]]:
    """One bucket as a fresh byte buffer (uint8, on `device`, by default the first tensor's) and each tensor's
    slot in it. Each tensor is copied straight into its slice, so the bucket costs one buffer of extra memory
    (a concatenation would also hold contiguous copies of strided views such as split q/k/v). Widest dtypes
    come first, which keeps every byte offset a multiple of its tensor's item size, so a slot reads back as a
    dtype view of its slice. `share_memory`: a CPU buffer goes to shared memory (it is then serialized as a
    handle rather than copied)."""
    ordered = sorted(bucket, key=lambda item: -item[1].element_size())
    total = sum(t.numel() * t.element_size() for _, t in ordered)
    flat = torch.empty(total, dtype=torch.uint8, device=device or ordered[0][1].device)
    if share_memory and flat.device.type == "cpu":
        flat.share_memory_()
    slots, offset = [], 0
    for name, tensor in ordered:
        nbytes = tensor.numel() * tensor.element_size()
        flat[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        slots.append((name, tensor.shape, tensor.dtype, offset, offset + nbytes))
        offset += nbytes
    return flat, slots


def unflatten(flat: Tensor, slots: list[Slot]) -> list[tuple[str, Tensor]]:
    """The tensors of a bucket `flatten` packed, as views of `flat`."""
    return [(name, flat[start:end].view(dtype).view(shape)) for name, shape, dtype, start, end in slots]


def push_weights(engine, named_tensors: Iterable[tuple[str, Tensor]], *, bucket_bytes: int, version: int) -> dict:
    """Stream `named_tensors` into `engine` as version `version`; returns counts for the metrics."""
    stats = {"tensors": 0, "bytes": 0, "buckets": 0}

    def counted():
        for bucket in buckets(named_tensors, bucket_bytes=bucket_bytes):
            stats["buckets"] += 1
            stats["tensors"] += len(bucket)
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket

    engine.update_weights(counted(), version=version)
    engine.flush_cache()
    log.debug("pushed weights v%d: %s", version, stats)
    return stats
