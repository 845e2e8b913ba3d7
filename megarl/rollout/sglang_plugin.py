"""megarl's SGLang plugin (setup.py registers `cpu_pinning` under SGLang's `sglang.srt.plugins` entry points), which
SGLang runs early in each of its processes: the engine, its schedulers and its detokenizer.

On a machine without a CUDA device, SGLang's CPU mode (SGLANG_USE_CPU_ENGINE=1) cannot page-lock host memory:
`pin_memory` and cudaHostRegister need CUDA and raise. SGLang's LoRA serving pins its adapter weights and batch
metadata (sglang/srt/lora: layers.py, lora.py, backend/torch_backend.py), and its MoE route capture registers
its routes buffer (sglang/srt/state_capturer/base.py, BaseHostCache, through the "cpu" entry of
sglang/srt/mem_cache/pool_host/common.py's ALLOC_MEMORY_FUNCS), so an engine started with LoRA adapters
(rollout.lora_sync: adapter) or route capture (MoE models) dies while it starts. In that mode alone, pinning
becomes a no-op and the routes buffer is plain memory: page-locking only speeds host-to-device copies, and
there is no device. Only SGLang's own processes change (those `multiprocessing` started: its schedulers, where
the LoRA layers and the routes buffer live, and its detokenizer): SGLang loads plugins in the process that
hosts the engine too, which is a trainer rank, and torch stays as it is there. Anywhere else (a GPU machine,
SGLang's GPU mode, no SGLang) the plugin changes nothing.
"""

from __future__ import annotations

import functools
import multiprocessing
import os

# torch's factory functions that take `pin_memory=` and that SGLang calls with it
_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")
_applied = False


def cpu_pinning() -> None:
    """In SGLang's processes in its CPU mode without a CUDA device: `Tensor.pin_memory()` returns the tensor
    itself and the factories ignore `pin_memory=True`. Idempotent."""
    global _applied
    if _applied or os.environ.get("SGLANG_USE_CPU_ENGINE") != "1" or multiprocessing.parent_process() is None:
        return
    import torch

    if torch.cuda.is_available():
        return
    _applied = True
    torch.Tensor.pin_memory = _unpinned_tensor
    for name in _FACTORIES:
        setattr(torch, name, _without_pinning(getattr(torch, name)))
    try:
        from sglang.srt.mem_cache.pool_host import common as host_pool
    except ImportError:  # a release that allocates host buffers some other way
        return
    if host_pool.ALLOC_MEMORY_FUNCS["cpu"] is host_pool.alloc_with_host_register:
        host_pool.ALLOC_MEMORY_FUNCS["cpu"] = _unregistered


def require(what: str) -> None:
    """RuntimeError, before SGLang starts (a scheduler dying at start-up takes its caller with it), unless SGLang
    will run this plugin: it finds it through megarl's installed entry points."""
    from importlib.metadata import entry_points

    if not any(ep.value == f"{__name__}:cpu_pinning" for ep in entry_points(group="sglang.srt.plugins")):
        raise RuntimeError(f"{what} on SGLang's CPU mode needs megarl's SGLang plugin ({__name__}), which SGLang "
                           "finds through megarl's installed entry points: install megarl in this environment "
                           "(pip install --no-deps -e .)")


def _unregistered(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """An ALLOC_MEMORY_FUNCS entry: the buffer from SGLang's allocator, not page-locked."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _unpinned_tensor(self, *args, **kwargs):
    return self


def _without_pinning(factory):
    @functools.wraps(factory)
    def call(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)
    return call
