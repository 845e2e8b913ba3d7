"""A trainer's device memory, lent to a co-located rollout engine between updates: on a GPU and on the CPU alike.

Gradients and optimizer state leave right after the optimizer step; parameters after the weight push
(the push reads them on the device); everything comes back before the next step's logprobs.

Every piece moves as a whole storage: its bytes go to a host buffer kept from step to step (pinned on a
GPU, so the copies run asynchronously), then the storage is resized to zero, which frees the memory and
keeps every view of it valid (DDP buckets, `main_grad`, the distributed optimizer's shards of the
parameter buffer); onload resizes it back and copies the bytes in. Gradient buffers are not copied: they
are zeroed when they come back, as after every step. Storages shared between pieces move once, with the
parameters (an fp32 optimizer steps the model's own parameters, or views of the parameter buffer).

With optim.cpu_offload, Megatron's HybridDeviceOptimizer keeps its share of the optimizer state in host memory
all the time and steps it there: that share is neither moved again nor counted as the device's; its device
optimizer's moments and fp32 master weights move like any optimizer's.

The CPU runs the same order of operations with its storage really freed, so a read of offloaded memory
fails in CPU tests as it would on a GPU (there it is an illegal memory access; here a crash or garbage).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megarl.device import on_gpu


@dataclass
class _Parked:
    storage: torch.UntypedStorage       # the device storage, resized to zero while parked
    nbytes: int                         # its size when resident
    host: torch.UntypedStorage | None   # its bytes while parked; None: zeroed when it comes back (gradients)
    kind: str                           # "params", "grads" or "optim"


class TrainerMemory:
    """Offload and onload of one model, whose `modules` are its chunks (one per virtual pipeline stage):
    `ddps` (one per chunk) and `optimizer` for a trained model, None for a frozen one."""

    def __init__(self, modules: list[torch.nn.Module], ddps: list | None = None, optimizer=None):
        self.modules, self.ddps, self.optimizer = modules, ddps, optimizer
        self._parked: list[_Parked] = []
        # host buffers by the identity of the storage they hold, kept while that storage lives in the model
        self._hosts: dict[int, torch.UntypedStorage] = {}

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of device memory this model has given back (parameters, gradients, optimizer state)."""
        return sum(parked.nbytes for parked in self._parked)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the parked state's buffers hold (page-locked on a GPU), kept from step to step."""
        return sum(host.nbytes() for host in self._hosts.values())

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the model on its device now, by kind ("params", "grads", "optim"), each storage counted once
        (with its first kind: parameters, then gradients, then optimizer state)."""
        seen: set[int] = set()
        out = {}
        for kind, tensors in (("params", self._param_tensors()),
                              ("grads", self._grad_tensors() if self.optimizer is not None else []),
                              ("optim", self._optimizer_tensors() if self.optimizer is not None else [])):
            storages = {_key(t): t.untyped_storage() for t in tensors if _key(t) not in seen}
            seen.update(storages)
            out[kind] = sum(storage.nbytes() for storage in storages.values())
        return out

    def offload_training_state(self) -> int:
        """Free the gradient buffers and move the optimizer state to the host; returns the bytes freed."""
        if self.optimizer is None:
            return 0
        model = {_key(t) for t in self._param_tensors()}
        freed = self._park(self._grad_tensors(), keep_bytes=False, kind="grads")
        state = [t for t in self._optimizer_tensors() if _key(t) not in model]
        # a loaded checkpoint replaces the optimizer's tensors: drop the host buffers of those that are gone
        live = model | {_key(t) for t in state}
        self._hosts = {key: host for key, host in self._hosts.items() if key in live}
        return freed + self._park(state, keep_bytes=True, kind="optim")

    def offload_params(self) -> int:
        """Move the parameters to the host; returns the bytes freed."""
        return self._park(self._param_tensors(), keep_bytes=True, kind="params")

    def free(self) -> int:
        """Free every storage of the model for good: parameters, gradient buffers, optimizer state; returns the
        bytes freed. For a model that is done (the warm start): its Python objects may outlive it, since
        Megatron's DDP hooks its parameters' gradient accumulators, reference cycles that pass through
        autograd's C++ nodes, which the garbage collector does not break."""
        tensors = self._param_tensors()
        if self.optimizer is not None:
            tensors += self._grad_tensors() + self._optimizer_tensors()
        freed = self._park(tensors, keep_bytes=False, kind="params")
        self._parked, self._hosts = [], {}
        return freed

    def onload(self, *, params_only: bool = False) -> None:
        """Bring back whatever was offloaded: parameters, gradient buffers (zeroed), optimizer state; with
        `params_only` the parameters alone (what an export reads), the rest staying on the host."""
        staying = []
        for parked in self._parked:
            if params_only and parked.kind != "params":
                staying.append(parked)
                continue
            parked.storage.resize_(parked.nbytes)
            if parked.host is None:
                parked.storage.fill_(0)
            else:
                parked.storage.copy_(parked.host, non_blocking=True)
        self._parked = staying

    def _park(self, tensors: Iterable[torch.Tensor], *, keep_bytes: bool, kind: str) -> int:
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:  # not parked yet (nor empty)
                storages.setdefault(_key(tensor), storage)
        freed = 0
        for key, storage in storages.items():
            host = None
            if keep_bytes:
                host = self._hosts.get(key)
                if host is None or host.nbytes() != storage.nbytes():
                    # Kept for the next steps: pinning again every step would double the host peak.
                    host = self._hosts[key] = _host_buffer(storage.nbytes())
                host.copy_(storage, non_blocking=True)
            nbytes = storage.nbytes()
            # On a GPU the caching allocator orders the freed block after the copy on this stream.
            storage.resize_(0)
            self._parked.append(_Parked(storage, nbytes, host, kind))
            freed += nbytes
        if freed and on_gpu():
            torch.cuda.empty_cache()  # to the driver: the rollout engine is another process
        return freed

    def _param_tensors(self) -> list[torch.Tensor]:
        """The parameters' storages: each DDP buffer's (with the distributed optimizer), else each parameter."""
        params = [param.data for module in self.modules for param in module.parameters()]
        if self.ddps is not None:
            params += [buffer.param_data for buffer in self._buffers() if buffer.param_data is not None]
        return params

    def _grad_tensors(self) -> list[torch.Tensor]:
        """The DDP buffers' gradients (a trained model's)."""
        return [buffer.grad_data for buffer in self._buffers() if buffer.grad_data is not None]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The optimizer's own parameters (fp32 main copies) and its state tensors, on the device. A scalar state
        (Adam's step count) stays: it is a few bytes, and copying one per parameter costs more than it frees."""
        tensors = []
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for inner in _device_optimizers(opt.optimizer):
                for group in inner.param_groups:
                    tensors += [p.data for p in group["params"]]
                for state in inner.state.values():
                    tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return tensors

    def _buffers(self) -> list:
        return [buffer for ddp in self.ddps for buffer in ddp.buffers + ddp.expert_parallel_buffers]


def _device_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers of one Megatron optimizer whose tensors live on the device: the optimizer itself, or
    of a HybridDeviceOptimizer (optim.cpu_offload) its device optimizer alone (none when it offloads all). Its
    host optimizers step host copies, which is also where its own `state` points for their share."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    if not isinstance(optimizer, HybridDeviceOptimizer):
        return [optimizer]
    return [optimizer.gpu_optimizer] if optimizer.gpu_optimizer is not None else []


def _key(tensor: torch.Tensor) -> int:
    """One storage's identity, whichever view of it `tensor` is (also while it is resized to zero)."""
    return tensor.untyped_storage()._cdata


def _host_buffer(nbytes: int) -> torch.UntypedStorage:
    """`nbytes` of host memory, page-locked on a GPU machine so the copies run asynchronously. Pinned through
    cudaHostRegister on a plain allocation: torch's caching host allocator (`pin_memory=True`) rounds every
    request up to a power of two (an 8.8 GB parameter buffer would lock 16 GiB), this locks the pages asked
    for. The registration ends with the buffer."""
    storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    if on_gpu() and nbytes:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(storage.data_ptr(), nbytes, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(error)}")
        weakref.finalize(storage, cudart.cudaHostUnregister, storage.data_ptr())
    return storage
