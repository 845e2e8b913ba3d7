"""A trainer's device memory, lent to a co-located rollout engine between updates (GPU only).

Gradients and optimizer state leave right after the optimizer step; parameters after the weight push
(the push reads them on the device); everything comes back before the next step's logprobs. Built on
megatron-core's RL helpers (0.16.1): `DistributedDataParallel.offload_grad_buffers` /
`restore_grad_buffers`, `_ParamAndGradBuffer.offload_to_cpu` / `reload_from_cpu` and
`MegatronOptimizer.offload_to_cpu` / `restore_from_cpu`. Two cases they do not cover are handled here:

- Without the distributed optimizer a DDP buffer holds only gradients (`param_data` is None): its
  parameters are separate tensors, parked one by one in reused pinned host buffers.
- Megatron's `FP32Optimizer` holds the model's own parameters in its param groups, and its
  `offload_to_cpu` would move them (breaking the push that follows); only its state moves here.

Storage is resized to zero rather than re-pointed, so every view (DDP buckets, `main_grad`) stays valid.
On CPU there is nothing to lend: each call is skipped and logged once.
"""

from __future__ import annotations

import gc
import logging

import torch

from megarl.device import on_gpu

log = logging.getLogger(__name__)
_logged_skips: set[str] = set()


class TrainerMemory:
    """Offload and onload of one model, whose `modules` are its chunks (one per virtual pipeline stage):
    `ddps` (one per chunk) and `optimizer` for a trained model, None for a frozen one."""

    def __init__(self, modules: list[torch.nn.Module], ddps: list | None = None, optimizer=None):
        self.modules, self.ddps, self.optimizer = modules, ddps, optimizer
        self._host: dict[torch.Tensor, torch.Tensor] = {}  # parked parameter -> its pinned host copy

    def offload_training_state(self) -> None:
        """Free the gradient buffers and move optimizer state to the host."""
        if _skip_on_cpu("trainer: offload_training_state"):
            return
        if self.optimizer is None:
            return
        for ddp in self.ddps:
            ddp.offload_grad_buffers(synchronize=True, empty_cache=False)
        for opt in _optimizers(self.optimizer):
            if _holds_model_params(opt):
                _move_state(opt, torch.device("cpu"))
            else:
                opt.offload_to_cpu()
        _release_cached_blocks()

    def offload_params(self) -> None:
        """Move the parameters to pinned host memory."""
        if _skip_on_cpu("trainer: offload_params"):
            return
        if self.ddps is None:
            self._park(param for module in self.modules for param in module.parameters())
        else:
            for buffer in self._buffers():
                if buffer.param_data is not None:
                    buffer.offload_to_cpu(move_params=True, move_grads=False)
                else:
                    self._park(buffer.params)
        _release_cached_blocks()

    def onload(self) -> None:
        """Bring back whatever was offloaded: parameters, gradient buffers (zeroed), optimizer state."""
        if _skip_on_cpu("trainer: onload"):
            return
        if self.ddps is None:
            self._unpark()
            return
        for buffer in self._buffers():
            if buffer.param_data is not None:
                buffer.reload_from_cpu(move_params=True, move_grads=False)
        self._unpark()
        for ddp in self.ddps:
            ddp.restore_grad_buffers(synchronize=False)
        device = torch.device("cuda", torch.cuda.current_device())
        for opt in _optimizers(self.optimizer):
            if _holds_model_params(opt):
                _move_state(opt, device)
            else:
                opt.restore_from_cpu()
        torch.cuda.synchronize()

    def _buffers(self) -> list:
        return [buffer for ddp in self.ddps for buffer in ddp.buffers + ddp.expert_parallel_buffers]

    def _park(self, params) -> None:
        for param in params:
            data = param.data
            storage = data.untyped_storage()
            if storage.nbytes() == 0:
                continue  # already parked
            if storage.nbytes() != data.nbytes or data.storage_offset() != 0:
                raise RuntimeError(f"cannot offload a parameter of shape {tuple(data.shape)} that shares its "
                                   "storage with other tensors")
            host = self._host.get(param)
            if host is None:
                # Pinned once and reused: pinning again every step doubles the host peak.
                host = self._host[param] = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            # The caching allocator orders the freed block after the copy on this stream.
            storage.resize_(0)

    def _unpark(self) -> None:
        for param, host in self._host.items():
            storage = param.data.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(host.nbytes)
                param.data.copy_(host, non_blocking=True)


def _optimizers(optimizer) -> list:
    """The Megatron optimizers inside a ChainedOptimizer, or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _holds_model_params(opt) -> bool:
    """Megatron's FP32Optimizer steps the model parameters themselves (no main-param copies)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return isinstance(opt, FP32Optimizer)


def _move_state(opt, device: torch.device) -> None:
    for state in opt.optimizer.state.values():
        for key, value in state.items():
            # Adam's step counter lives on the host unless the optimizer is capturable; leave it there.
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device)


def _release_cached_blocks() -> None:
    """Return freed blocks to the driver, so the rollout engine in another process can allocate them."""
    gc.collect()
    torch.cuda.empty_cache()


def _skip_on_cpu(what: str) -> bool:
    if on_gpu():
        return False
    if what not in _logged_skips:
        _logged_skips.add(what)
        log.debug("%s skipped on CPU (GPU-only operation); logged once", what)
    return True
