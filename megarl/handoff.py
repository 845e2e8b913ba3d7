"""Weight handoff from the trainer to a rollout engine: full HF tensors in byte-bounded buckets.

The trainer yields full HF-named tensors one at a time (TP shards gathered, pipeline stages relayed);
`buckets` groups them into lists of at most `bucket_bytes` (a larger tensor travels alone), and
`push_weights` hands those to the engine under a version number. Everything is a generator, so peak
extra memory is about one bucket plus the largest tensor, whatever the model size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

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
