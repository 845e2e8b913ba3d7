"""How the two sides of a placement-split job talk (megarl.loops.split): the job's key-value store for small
control messages, and process groups of their own for everything that grows with the batch or the model.

- `Mailbox`: keys of torchrun's store (one process on one host, which also serves rendezvous), for commands,
  readiness flags and the end of the run; tens of bytes each, whatever the batch.
- `Link`: pickled messages in one direction between members of a process group made by the processes that
  use it (the workers have no torch.distributed world): gloo on CPU, NCCL on GPU, where the payload crosses on
  the device. Prompts go one way on one link and samples the other way on another, so a send never waits
  behind a message in the opposite direction. Between two members, messages arrive in the order sent.
- `send_header` / `receive_header`: a weight bucket's names and shapes, broadcast over the weight push's own
  group ahead of the bucket.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from megarl.device import current_device, on_gpu

# what each kind of key carries, for the error of a wait that timed out
_WHAT = {"cmd": "a rollout worker's next command", "ready": "a worker ready for a weight push",
         "done": "the end of the training ranks' run"}


class Mailbox:
    """Keys of the job's store holding pickled plain data (commands and flags: small, whatever the batch)."""

    def __init__(self, store: dist.Store, timeout: timedelta):
        self.store, self.timeout = dist.PrefixStore("megarl/split/", store), timeout
        self.written = 0  # bytes this process posted (async/store_bytes)

    def put(self, key: str, value) -> None:
        data = pickle.dumps(value)
        self.written += len(data)
        self.store.set(key, data)

    def take(self, key: str, *, keep: bool = False):
        """The value of `key`, waiting for it to be posted (up to parallel.timeout_minutes); removed unless
        `keep`."""
        try:
            self.store.wait([key], self.timeout)
        except dist.DistStoreError:
            raise TimeoutError(f"placement split: waited {self.timeout} (parallel.timeout_minutes) for {key!r} "
                               f"({_WHAT.get(key.split('/')[0], 'a message')}) from the other side of the job"
                               ) from None
        value = pickle.loads(self.store.get(key))
        if not keep:
            self.store.delete_key(key)
        return value

    def drop(self, key: str) -> None:
        self.store.delete_key(key)

    def ready(self, key: str) -> bool:
        """Whether `key` is posted (without waiting)."""
        return self.store.check([key])


def own_group(store: dist.Store, name: str, *, member: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A process group of `size` members made by those processes only, outside torch.distributed's world,
    meeting under `name` in the job's store: gloo on CPU, NCCL on GPU. Every member makes it (gloo connects
    them all when it is made)."""
    backend = dist.ProcessGroupNCCL if on_gpu() else dist.ProcessGroupGloo
    return backend(dist.PrefixStore(f"megarl/{name}/", store), member, size, timeout)


class Link:
    """Pickled messages in one direction over a group of their own (`own_group`). A send returns at once
    (its buffers are kept until it is taken); a receive waits for the next message from that member."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.in_flight: list[tuple[object, Tensor]] = []  # sends not known to be taken yet, with their buffers
        self.bytes = 0  # payload bytes sent and received by this process

    def send(self, value, to: int) -> None:
        self.in_flight = [(work, buffer) for work, buffer in self.in_flight if not work.is_completed()]
        size, data = _framed(value)
        for buffer in (size, data):
            self.in_flight.append((self.group.send([buffer], to, 0), buffer))
        self.bytes += data.numel()

    def receive(self, sender: int):
        data = _unframed(lambda buffer: self.group.recv([buffer], sender, 0).wait())
        self.bytes += data.numel()
        return pickle.loads(data.cpu().numpy().tobytes())


def send_header(group: dist.ProcessGroup, value) -> None:
    """Broadcast `value` (pickled) from member 0 of `group` to the others."""
    for buffer in _framed(value):
        group.broadcast(buffer, 0).wait()


def receive_header(group: dist.ProcessGroup):
    """What member 0 of `group` broadcast with `send_header`."""
    data = _unframed(lambda buffer: group.broadcast(buffer, 0).wait())
    return pickle.loads(data.cpu().numpy().tobytes())


def _framed(value) -> tuple[Tensor, Tensor]:
    """`value` pickled, as two device tensors to send in order: its size in bytes, then the bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(current_device())
    return torch.tensor([data.numel()], dtype=torch.int64, device=data.device), data


def _unframed(fill) -> Tensor:
    """The bytes of a message framed by `_framed`, each of its two tensors filled by `fill(buffer)`."""
    size = torch.zeros(1, dtype=torch.int64, device=current_device())
    fill(size)
    data = torch.empty(int(size), dtype=torch.uint8, device=current_device())
    fill(data)
    return data
