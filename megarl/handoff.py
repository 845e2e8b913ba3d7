"""Weight handoff from the trainer to a rollout engine: full HF tensors in byte-bounded buckets.

The trainer yields full HF-named tensors one at a time (TP shards gathered, pipeline stages relayed);
`buckets` groups them into lists of at most `bucket_bytes` (a larger tensor travels alone), and
`push_weights` hands those to the engine under a version number. Everything is a generator, so peak
extra memory is about one bucket plus the largest tensor, whatever the model size. Where a bucket crosses a
process as one byte buffer (SGLang's flattened bucket, the broadcast to split placement's rollout ranks),
`flatten` packs it and `unflatten` reads the tensors back as views of the buffer.

A push proves itself (`rollout.verify_weights`): as the tensors stream past, the trainer takes a `Fingerprint`
of those the push verifies (`WeightCheck`: all of them at a run's first push; after it none, a rotating share,
or all), an exact checksum of their bytes and their first values, and never a copy. Once the engine has
loaded the push, `verify_engine` reads the same tensors back from the engine (RolloutEngine.read_weights),
fingerprints them there and stops at the first that differs, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

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


def push_weights(engine, named_tensors: Iterable[tuple[str, Tensor]], *, bucket_bytes: int, version: int,
                 verify: Callable[[int], bool] = lambda index: False, dtype: torch.dtype | None = None,
                 engine_name: str = "the rollout engine") -> dict:
    """Stream `named_tensors` into `engine` as version `version`, then compare the engine's copy of the tensors
    `verify(index in the stream)` selects with the trainer's, both rounded to `dtype`, the engine's (None: as
    pushed), by `verify_engine`, which names `engine_name` when one differs, or where the engine loads them (an
    engine whose `update_weights` checks `expected` itself). Returns counts for the metrics (`verified`: the
    tensors compared; checked in the engine, each TP rank's shard counts)."""
    stats = {"tensors": 0, "bytes": 0, "buckets": 0, "largest_bucket_bytes": 0, "largest_tensor_bytes": 0}
    expected: dict[str, Fingerprint] = {}

    def counted():
        for bucket in buckets(fingerprinted(named_tensors, verify, into=expected, dtype=dtype),
                              bucket_bytes=bucket_bytes):
            sizes = [t.numel() * t.element_size() for _, t in bucket]
            stats["buckets"] += 1
            stats["tensors"] += len(bucket)
            stats["bytes"] += sum(sizes)
            stats["largest_bucket_bytes"] = max(stats["largest_bucket_bytes"], sum(sizes))
            stats["largest_tensor_bytes"] = max(stats["largest_tensor_bytes"], *sizes)
            yield bucket

    # an engine that checks the tensors where it loads them (SGLang: in every TP scheduler) says how many it did
    checked = engine.update_weights(counted(), version=version, expected=expected)
    engine.flush_cache()
    stats["verified"] = (checked if checked is not None else
                         verify_engine(engine, expected, version=version, engine_name=engine_name))
    log.debug("pushed weights v%d: %s", version, stats)
    return stats


# ---- verification --------------------------------------------------------------------------------------
VERIFY_MODES = ("first", "sampled", "every", "off")
_ROW_WORDS = 64  # 8-byte words summed into one row sum: a value moved to another 512-byte row shows
_CHUNK_ROWS = 1 << 16  # row sums weighted at a time (32 MiB of the tensor)
_FACTORS: dict[torch.device, Tensor] = {}
_warned_unreadable: set[str] = set()  # engines that cannot read some tensors back, warned about once


@dataclass(frozen=True)
class Fingerprint:
    """One tensor's bytes, checked exactly in two integers, and its first values (for messages)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    words: int                # the bytes read as 8-byte integers, summed mod 2**64
    rows: int                 # the sums of each 64 words (a row), times fixed pseudo-random factors, summed mod
                              # 2**64: a value moved to another row (a transposed or misplaced shard) changes it
    head: tuple[float, ...]   # the first values

    def same(self, other: Fingerprint) -> bool:
        return (self.shape, self.dtype, self.words, self.rows) == (other.shape, other.dtype, other.words, other.rows)

    def __str__(self) -> str:
        head = ", ".join(f"{v:.6g}" for v in self.head)
        return (f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)} first [{head}], checksums "
                f"{self.words:016x} {self.rows:016x}")


def _factors(device: torch.device) -> Tensor:
    """[_CHUNK_ROWS] int64: odd factors below 2**31, the same on every device and in every process."""
    if device not in _FACTORS:
        gen = torch.Generator().manual_seed(0x5EED)
        factors = torch.randint(0, 2**30, (_CHUNK_ROWS,), generator=gen, dtype=torch.int64) * 2 + 1
        _FACTORS[device] = factors.to(device)
    return _FACTORS[device]


def _words(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """A tensor's bytes as int64 words [n] (a view where its offset allows) and its last n % 8 bytes as int64."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    try:
        words = flat[:whole].view(torch.int64)
    except RuntimeError:  # an offset into its storage that is not a multiple of 8 bytes
        words = flat[:whole].clone().view(torch.int64)
    return words, flat[whole:].to(torch.int64)


@torch.no_grad()
def fingerprint(tensor: Tensor) -> Fingerprint:
    """The tensor's Fingerprint, computed where it lies: one pass of integer sums over its bytes and one host
    sync. Integer sums wrap mod 2**64 alike in any order, so devices and processes agree exactly on equal bytes."""
    words, tail = _words(tensor)
    n_rows = words.numel() // _ROW_WORDS
    rows = words[: n_rows * _ROW_WORDS].view(n_rows, _ROW_WORDS)
    # the words after the last whole row and the bytes after the last whole word count as rows of their own
    loose = torch.cat([words[n_rows * _ROW_WORDS:], tail])
    factors = _factors(words.device)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    chunks = [rows[start: start + _CHUNK_ROWS].sum(dim=1) for start in range(0, n_rows, _CHUNK_ROWS)]
    for c, row_sums in enumerate(chunks + [loose]):
        sums[0] += row_sums.sum()
        sums[1] += (row_sums * factors[: row_sums.numel()]).sum() * (2 * c + 1)
    plain, weighted = (v % 2**64 for v in sums.tolist())
    head = tensor.detach().reshape(-1)[:4]
    return Fingerprint(shape=tuple(tensor.shape), dtype=tensor.dtype, words=plain, rows=weighted,
                       head=tuple(head.double().tolist() if head.is_floating_point() else head.tolist()))


def fingerprinted(named_tensors: Iterable[tuple[str, Tensor]], verify: Callable[[int], bool], *,
                  into: dict[str, Fingerprint], dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """The stream unchanged, with the Fingerprint of each tensor `verify(its index)` selects put `into` the dict
    as it passes (the trainer keeps no copy). A floating-point tensor is fingerprinted as the engine holds it,
    rounded to `dtype` (the engines load with a cast: an fp32 norm of a bf16 run arrives as bf16), which takes
    one tensor's temporary copy where the dtypes differ."""
    for index, (name, tensor) in enumerate(named_tensors):
        if verify(index):
            rounded = dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype
            into[name] = fingerprint(tensor.to(dtype) if rounded else tensor)
        yield name, tensor


class WeightCheck:
    """Which tensors of each push of a run are verified (`rollout.verify_weights`): first: every tensor at the
    run's first push, none after; sampled: every tensor at the first push, then, at the push of weight version
    v, the tensors at stream positions i = v (mod period), so every tensor again within `period` pushes; every:
    all at every push; off: none. The rotation follows the version, which a resumed run continues, so it
    checks what the run it continues would have."""

    def __init__(self, mode: str, *, period: int):
        if mode not in VERIFY_MODES:
            raise ValueError(f"rollout.verify_weights must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
        if period < 1:
            raise ValueError(f"rollout.verify_period must be >= 1, got {period}")
        self.mode, self.period, self.first = mode, period, True

    def select(self, version: int) -> Callable[[int], bool]:
        """The predicate (stream position -> verify?) of the push of `version`, the next push of the run."""
        first, period = self.first, self.period
        self.first = False
        match self.mode:
            case "off":
                return lambda index: False
            case "first":
                return lambda index: first
            case "every":
                return lambda index: True
        return lambda index: first or index % period == version % period


class WeightMismatch(RuntimeError):
    """A rollout engine holds other weights than the trainer pushed."""


def verify_engine(engine, expected: dict[str, Fingerprint], *, version: int, engine_name: str) -> int:
    """Compare the engine's copy of every tensor in `expected` (name -> the trainer's Fingerprint, in push order;
    the engine's copy is rounded to its dtype first) with the trainer's; raise WeightMismatch at the first that
    differs. Returns how many were compared: a tensor the engine cannot read back (RolloutEngine.read_weights
    gives None) is skipped, with a warning once."""
    if not expected:
        return 0
    verified, unreadable = 0, []
    for name, held in engine.read_weights(list(expected)):
        want = expected[name]
        if held is None:
            unreadable.append(name)
            continue
        got = fingerprint(held if held.dtype == want.dtype else held.to(want.dtype))
        if not got.same(want):
            raise WeightMismatch(
                f"weight push of version {version}: {engine_name} holds another {name!r} than the trainer pushed: "
                f"engine {got} (held as {str(held.dtype).removeprefix('torch.')}) vs trainer {want}. The engine did "
                "not load the pushed tensor (or loaded it into another place): check the HF name table "
                "(megarl.models.names) and the engine's load path (found by the push checks, rollout.verify_weights)")
        verified += 1
    if unreadable and engine_name not in _warned_unreadable:
        _warned_unreadable.add(engine_name)
        log.warning("%s cannot read back %d of the %d tensors verified at weight push %d (first: %r): those are "
                    "checked by the weight versions and the logprob drift only", engine_name, len(unreadable),
                    len(expected), version, unreadable[0])
    return verified
