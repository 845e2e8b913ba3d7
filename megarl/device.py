"""Which device this process computes on, and what a machine without a CUDA driver needs to import CUDA builds.

Used by the trainer and by both rollout engines, so neither package imports the other for it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def on_gpu() -> bool:
    """True when a CUDA device is usable: the GPU paths (NCCL, memory release, CUDA IPC) run; else the CPU ones."""
    return torch.cuda.is_available()


def current_device() -> torch.device:
    """The device this rank's tensors live on: its CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


def release_cached_blocks() -> None:
    """Return the device memory this process freed to the driver, so that another process (a rollout
    engine sizing or taking back its memory) can allocate it; on the CPU, only the collector runs."""
    gc.collect()  # what reference cycles held is freed by the collector only
    if on_gpu():
        torch.cuda.empty_cache()


def host_barrier(group=None) -> None:
    """Wait for every rank of `group` (None: the world) on the host side: a one-element all-reduce of a host
    tensor, which megarl's process groups serve with gloo (megarl.engine.parallel.world_backend). No device
    work is queued behind it and no NCCL communicator is made for it."""
    dist.all_reduce(torch.zeros(1), group=group)


# CUDA driver stand-in: torch CUDA builds (the ones SGLang pins) ship kernel libraries that link against
# libcuda, and some are loaded at import time (SGLang's kernels, flash_mla under megatron's attention).
# On a machine without a driver every entry point here reports "no device", which is the truth there.
_DRIVER_STAND_IN_C = """
#define CUDA_ERROR_NO_DEVICE 100
int cuInit(unsigned int flags) { return CUDA_ERROR_NO_DEVICE; }
int cuDriverGetVersion(int *v) { if (v) *v = 0; return CUDA_ERROR_NO_DEVICE; }
int cuDeviceGetCount(int *n) { if (n) *n = 0; return CUDA_ERROR_NO_DEVICE; }
int cuPointerGetAttribute(void *d, int a, unsigned long long p) { return CUDA_ERROR_NO_DEVICE; }
"""


def load_cuda_driver_stand_in() -> None:
    """When no `libcuda.so.1` loads, build the stand-in above, load it into this process and put it on
    LD_LIBRARY_PATH for child processes. A real driver, when present, is always used instead."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    folder = Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl")) / "cuda-driver-stand-in"
    lib = folder / "libcuda.so.1"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src = Path(tmp) / "stand_in.c"
            src.write_text(_DRIVER_STAND_IN_C)
            built = Path(tmp) / "libcuda.so.1"
            subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(built), str(src)],
                           check=True, capture_output=True)
            os.replace(built, lib)  # atomic: ranks starting together never load a half-written file
    # Loaded by soname, later dlopen("libcuda.so.1") calls in this process resolve to it.
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(folder), *paths])
