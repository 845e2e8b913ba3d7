"""Megatron-core's import without TorchDynamo and Inductor.

megatron-core wraps its fused elementwise functions (SwiGLU, GeGLU, bias-dropout-add, ...) in `torch.compile`
as it imports them (`megatron.core.jit.jit_fuser`), and `torch.compile` imports TorchDynamo and Inductor on the
spot: about 2 s of a run's start on CPU, paid even by a run that never calls one of them (every CPU run, and a
GPU run whose recipe turns the fusions off). While `megatron.core` imports, `torch.compile` hands out
wrappers that make the same `torch.compile` call at their first call instead, so a fused function is compiled
exactly as before, only later. `megarl.engine` installs the import hook; a process that imported
`megatron.core` before it keeps megatron's own behaviour.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def compile_on_first_call() -> Iterator[None]:
    """Inside the block, `torch.compile(fn, **options)` of a plain function returns a wrapper that calls
    `torch.compile(fn, **options)` at its first call and the compiled function from then on; modules and
    everything else go to `torch.compile` at once."""
    compile_now = torch.compile

    def compile_later(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return functools.partial(compile_later, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    torch.compile = compile_later
    try:
        yield
    finally:
        torch.compile = compile_now


class _MegatronImport(importlib.abc.MetaPathFinder):
    """Runs the first import of `megatron.core` (its `__init__` imports the whole package) inside
    `compile_on_first_call`, then leaves the import system."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_deferring_compile(module):
            with compile_on_first_call():
                exec_module(module)

        spec.loader.exec_module = exec_deferring_compile
        return spec


def install() -> None:
    """Defer megatron-core's torch.compile calls, unless `megatron.core` is already imported (or hooked)."""
    if "megatron.core" not in sys.modules and not any(isinstance(f, _MegatronImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronImport())
