"""Weight handoff buckets: bounded size (an oversized tensor travels alone), order kept, nothing lost,
streamed lazily; and push_weights' counts."""

from __future__ import annotations

import pytest
import torch

from megarl.handoff import buckets, push_weights


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def named(sizes_and_dtypes) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (n, dtype) in enumerate(sizes_and_dtypes)]


TENSORS = named([(10, torch.float32), (20, torch.float32), (5, torch.float32), (50, torch.float32),  # 50*4 > 100
                 (8, torch.bfloat16), (40, torch.bfloat16), (25, torch.float32), (1, torch.float32),
                 (200, torch.bfloat16), (3, torch.float32)])


@pytest.mark.parametrize("bucket_bytes", [1, 64, 100, 160, 10_000])
def test_buckets_are_bounded_ordered_and_complete(bucket_bytes):
    out = list(buckets(iter(TENSORS), bucket_bytes=bucket_bytes))
    assert all(out), "no empty bucket"
    for bucket in out:
        size = sum(nbytes(t) for _, t in bucket)
        assert size <= bucket_bytes or len(bucket) == 1, (bucket_bytes, [n for n, _ in bucket], size)
    flat = [item for bucket in out for item in bucket]
    assert [n for n, _ in flat] == [n for n, _ in TENSORS]  # order kept, every tensor once
    assert all(a is b for (_, a), (_, b) in zip(flat, TENSORS))  # the same tensors, not copies


def test_buckets_fill_up_before_starting_a_new_one():
    # Each bucket is closed only because the next tensor would not fit in it.
    bucket_bytes = 100
    out = list(buckets(TENSORS, bucket_bytes=bucket_bytes))
    for bucket, following in zip(out, out[1:]):
        size = sum(nbytes(t) for _, t in bucket)
        assert size + nbytes(following[0][1]) > bucket_bytes


def test_oversized_tensor_travels_alone():
    tensors = named([(4, torch.float32), (100, torch.float32), (4, torch.float32)])
    out = list(buckets(tensors, bucket_bytes=32))
    assert [[n for n, _ in b] for b in out] == [["t0"], ["t1"], ["t2"]]


def test_buckets_stream_without_reading_ahead():
    consumed = []

    def source():
        for item in TENSORS:
            consumed.append(item[0])
            yield item

    stream = buckets(source(), bucket_bytes=100)
    first = next(stream)
    # Only the first bucket plus the one tensor that did not fit have been pulled from the source.
    assert len(consumed) == len(first) + 1


@pytest.mark.parametrize("bucket_bytes", [0, -1])
def test_non_positive_bucket_bytes_raise(bucket_bytes):
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(buckets(TENSORS, bucket_bytes=bucket_bytes))


def test_push_weights_hands_every_bucket_to_the_engine_with_its_version():
    class RecordingEngine:
        def __init__(self):
            self.received, self.version, self.flushed = [], None, False

        def update_weights(self, bucket_stream, *, version, expected=None):
            self.received = [[n for n, _ in b] for b in bucket_stream]
            self.version = version

        def flush_cache(self):
            self.flushed = True

    engine = RecordingEngine()
    stats = push_weights(engine, iter(TENSORS), bucket_bytes=100, version=3)
    assert engine.version == 3 and engine.flushed
    assert [n for b in engine.received for n in b] == [n for n, _ in TENSORS]
    sizes = {name: nbytes(t) for name, t in TENSORS}
    assert stats == {"tensors": len(TENSORS), "bytes": sum(sizes.values()), "buckets": len(engine.received),
                     "largest_bucket_bytes": max(sum(sizes[n] for n in b) for b in engine.received),
                     "largest_tensor_bytes": max(sizes.values()),
                     "verified": 0}  # nothing asked to be verified
