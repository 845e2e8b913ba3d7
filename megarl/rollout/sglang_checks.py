"""Weight checks inside SGLang's schedulers: every TP rank proves what it loaded in a push, for every model class.

SGLang can read a weight back only for a few model classes (not Qwen2, Qwen3 or the MoE classes), as float32
Python lists, and only TP rank 0's shard. So megarl loads its pushes through a loader of its own
(`load_bucket`, named in the engine's `custom_weight_loader` and in each push's `load_format`), which every TP
scheduler runs on the bucket it opened:

1. The bucket arrives as one entry: this rank's own byte buffer (a `LocalSerializedTensor` holding one per TP
   rank, each made by the trainer rank on that device) under a name that holds the header (each tensor's slot in
   the buffer, and the trainer's Fingerprint of those the push verifies, megarl.handoff's). Each tensor the push
   verifies is fingerprinted as it arrived and compared with the trainer's.
2. The model's own `load_weights` loads the bucket, as SGLang's default path does, with each verified tensor
   wrapped so that every copy of a piece of it into a parameter is recorded (the destination view, and the
   Fingerprint of the piece as the parameter's dtype holds it).
3. Once the bucket is loaded, each recorded destination is fingerprinted again and compared with its piece: a
   parameter slice that a later tensor overwrote, or a tensor SGLang skipped (no piece loaded anywhere), fails.

What each rank found is kept until the host asks for it (`report`, which SGLang answers through its
`get_weights_by_name` request with a name of megarl's own): the TP ranks gather their reports over SGLang's
TP group and rank 0's answer carries them all. The host raises on the first failure, naming the tensor and the
rank. Nothing here raises inside SGLang: a loader that raised would take the scheduler down.
"""

from __future__ import annotations

import json

import torch
from torch import Tensor

REPORT_NAME = "megarl.weight_report"  # the `get_weights_by_name` name that asks for the report
LOADER = f"{__name__}.load_bucket"
HEADER = "megarl.bucket:"  # the name a bucket's buffer travels under begins so; the header follows

_checked = 0  # verified tensors this rank loaded and found as pushed since the last report
_failures: list[str] = []  # what differed on this rank since the last report, in push order
_patched = False


def header(slots: list, expected: dict) -> str:
    """A bucket's header, the name its buffer travels under: its slots (name, shape, dtype, first byte, end byte)
    and, for the tensors the push verifies, the trainer's Fingerprint (words, rows, and the dtype it was taken in:
    the engine's, which a tensor pushed in another dtype is rounded to first). A string, pickled by value: a host
    tensor would travel as a handle to this process's memory, which a scheduler on another node cannot open."""
    def dtype_name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    slot_list = [(name, list(shape), dtype_name(dtype), start, end) for name, shape, dtype, start, end in slots]
    expect = {name: [fp.words, fp.rows, dtype_name(fp.dtype)] for name, fp in expected.items()}
    return HEADER + json.dumps({"slots": slot_list, "expect": expect})


def load_bucket(model, named_tensors: list[tuple[str, Tensor]]) -> None:
    """SGLang's custom weight loader (in each TP scheduler): the bucket's tensors from this rank's buffer,
    checked as they arrive, loaded by the model's own `load_weights`, and the loaded pieces checked."""
    global _checked
    _patch_report()
    (name, flat), = named_tensors
    meta = json.loads(name.removeprefix(HEADER))
    expect = meta["expect"]
    stream, copies, wrong = [], [], set()
    for name, shape, dtype, start, end in meta["slots"]:
        tensor = flat[start:end].view(getattr(torch, dtype)).view(shape)
        if name in expect:
            *want, dtype_taken = expect[name]
            rounded = getattr(torch, dtype_taken)
            if _fingerprint(tensor if tensor.dtype == rounded else tensor.to(rounded)) != want:
                wrong.add(name)
                _failures.append(f"{name!r} arrived with other bytes than the trainer pushed")
            tensor = _Arrived.of(tensor, (name,), copies)
        stream.append((name, tensor))
    model.load_weights(stream)
    loaded = set()
    for names, destination, piece in copies:
        loaded.update(names)
        if _fingerprint(destination) != piece:
            for name in (n for n in names if n not in wrong):
                wrong.add(name)
                _failures.append(f"{name!r}: a piece loaded into a parameter is not there after the bucket "
                                 "(another tensor overwrote it, or the loader wrote elsewhere)")
    _failures.extend(f"{name!r} was not loaded into any parameter (the model skipped its name)"
                     for name in expect if name not in loaded)
    _checked += len(loaded - wrong)


def report() -> dict:
    """This rank's checks since the last report, then cleared."""
    global _checked
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    mine = {"rank": get_tensor_model_parallel_rank(), "checked": _checked, "failures": list(_failures)}
    _checked = 0
    _failures.clear()
    return mine


def _patch_report() -> None:
    """SGLang's `get_weights_by_name` request, on every TP rank, answers REPORT_NAME with the reports of all TP
    ranks (gathered over SGLang's TP CPU group; every rank takes the request, rank 0 answers)."""
    global _patched
    if _patched:
        return
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.managers.tp_worker import TpModelWorker

    original = TpModelWorker.get_weights_by_name

    def get_weights_by_name(self, recv_req):
        if recv_req.name != REPORT_NAME:
            return original(self, recv_req)
        group = get_tp_group().cpu_group
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, report(), group=group)
        return reports

    TpModelWorker.get_weights_by_name = get_weights_by_name
    _patched = True


def _fingerprint(tensor: Tensor) -> list[int]:
    from megarl.handoff import fingerprint

    got = fingerprint(tensor)
    return [got.words, got.rows]


class _Arrived(Tensor):
    """A verified tensor inside the model's `load_weights`: what the loader makes of it (views, casts, pieces, and
    concatenations with other verified tensors: a fused q/kv projection) stays of this kind, carrying the names of
    the tensors it holds, and each copy of one into a parameter is recorded in `copies` as (names, destination,
    Fingerprint of the piece as the destination's dtype holds it)."""

    _megarl_names: tuple[str, ...]
    _megarl_copies: list

    @classmethod
    def of(cls, tensor: Tensor, names: tuple[str, ...], copies: list) -> _Arrived:
        arrived = tensor.as_subclass(cls)
        arrived._megarl_names, arrived._megarl_copies = names, copies
        return arrived

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sources = [a for a in _flat(args) + _flat(list(kwargs.values())) if isinstance(a, _Arrived)]
        plain, plain_kwargs = _plain(args), _plain(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*plain, **plain_kwargs)
            if func is Tensor.copy_ and not isinstance(args[0], _Arrived):
                _record(sources, plain[0], plain[1])
                return out
            if func is Tensor.__setitem__ and not isinstance(args[0], _Arrived) and isinstance(args[2], _Arrived):
                _record(sources, plain[0][plain[1]], plain[2])
                return out
        if not sources:
            return out
        names, copies = _names(sources), sources[0]._megarl_copies
        if isinstance(out, (tuple, list)):  # chunk, split, unbind: each piece stays recorded
            return type(out)(cls.of(t, names, copies) if isinstance(t, Tensor) else t for t in out)
        if isinstance(out, Tensor) and not isinstance(out, _Arrived):
            return cls.of(out, names, copies)
        return out


def _flat(items) -> list:
    """The tensors among `items`, one level of lists and tuples opened (torch.cat's list of pieces)."""
    out = []
    for item in items:
        out += list(item) if isinstance(item, (list, tuple)) else [item]
    return out


def _plain(value):
    """`value` with every _Arrived in it (one level of lists, tuples and dicts opened) as a plain tensor."""
    if isinstance(value, _Arrived):
        return value.as_subclass(Tensor)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) if isinstance(v, (_Arrived, list, tuple)) else v for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _names(sources: list[_Arrived]) -> tuple[str, ...]:
    """The pushed tensors `sources` hold pieces of, each once, in order."""
    return tuple(dict.fromkeys(name for a in sources for name in a._megarl_names))


def _record(sources: list[_Arrived], destination: Tensor, piece: Tensor) -> None:
    held = piece.to(destination.dtype) if piece.dtype != destination.dtype else piece
    sources[0]._megarl_copies.append((_names(sources), destination, _fingerprint(held.expand_as(destination))))
