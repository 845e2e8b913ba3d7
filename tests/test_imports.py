"""What importing megarl's modules costs: none of them loads a heavy backend at import time (STYLE 6: those
are imported lazily, inside the functions that drive them), megatron's compiled functions compile at their
first call, and no module grows past what a reader takes in. Which module may import which (no cycle, the
rooms' order) is tests/test_structure.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import run_python

HEAVY = ("megatron", "sglang", "transformer_engine", "apex", "ray", "wandb", "mlflow")
PACKAGE = Path(__file__).resolve().parents[1] / "megarl"


def module_names() -> list[str]:
    """Every module of the megarl package, by dotted name."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


# Modules that subclass Megatron's classes; only the functions that build a Megatron model import them
# (te_attention, Megatron's Transformer Engine layer: only where TE is installed, tools/check_gpu_imports.py).
MEGATRON_EXTENSIONS = ("megarl.engine.local_attention", "megarl.engine.lazy_checkpoint",
                       "megarl.engine.lora_layers", "megarl.engine.te_attention", "megarl.engine.local_experts",
                       "megarl.engine.gemma")
# `python -m megarl` runs the command line when imported
LIGHT_MODULES = tuple(m for m in module_names() if m not in MEGATRON_EXTENSIONS and m != "megarl.__main__")


@pytest.mark.timeout(90)
def test_importing_megarl_modules_loads_no_heavy_backend():
    code = (
        "import importlib, sys\n"
        f"for name in {LIGHT_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('HEAVY', heavy)\n"
    )
    result = run_python(["-c", code], timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout


@pytest.mark.timeout(90)
def test_megatron_imports_without_torch_compiles_stack_and_compiles_at_first_call():
    """megatron-core wraps its fused functions in torch.compile as it imports; imported through megarl.engine,
    that happens at their first call instead, so TorchDynamo and Inductor (about 2 s) load only for a run that
    calls one. The deferred wrapper compiles with the options it was given (the eager backend here: no C++
    compiler needed), once, and computes what the function does; torch.compile itself is left as it was."""
    code = """
import sys, torch
original = torch.compile
import megarl.engine
import megatron.core.transformer, megatron.core.models.gpt, megatron.core.distributed, megatron.core.optimizer
from megatron.core.fusions import fused_bias_swiglu
assert torch.compile is original
assert fused_bias_swiglu.swiglu.__wrapped__.__name__ == "swiglu"  # a deferred wrapper around megatron's function
compile_stack = [m for m in ("torch._dynamo", "torch._inductor.compile_fx") if m in sys.modules]
assert not compile_stack, compile_stack
from megarl.engine.deferred_compile import compile_on_first_call
calls = []
def counted(model, **options):
    calls.append(options)
    return original(model, **options)
torch.compile = counted
with compile_on_first_call():
    affine = torch.compile(lambda x: 2 * x + 1, backend="eager")
    @torch.compile(backend="eager", dynamic=False)
    def square(x):
        return x * x
torch.compile = original
assert calls == [] and "torch._dynamo" not in sys.modules
x = torch.arange(4.0)
assert torch.equal(affine(x), 2 * x + 1) and torch.equal(affine(x + 1), 2 * x + 3)
assert torch.equal(square(x), x * x)
assert calls == [{"backend": "eager"}, {"backend": "eager", "dynamic": False}], calls
assert "torch._dynamo" in sys.modules
print("deferred")
"""
    result = run_python(["-c", code], timeout_s=80)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deferred" in result.stdout


MAX_MODULE_LINES = 550  # a module a reader takes in whole; config.py is one declaration per recipe section
MAX_FUNCTION_LINES = 80  # in the packages the loop runs through (loops, engine, rollout)


def test_no_module_or_loop_function_grows_past_what_a_reader_takes_in():
    long_modules = [f"{path.relative_to(PACKAGE.parent)}: {n} lines"
                    for path in sorted(PACKAGE.rglob("*.py")) if path.name != "config.py"
                    and (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    long_functions = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: "
                      f"{node.end_lineno - node.lineno + 1} lines"
                      for package in ("loops", "engine", "rollout") for path in sorted((PACKAGE / package).glob("*.py"))
                      for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long_modules == [] and long_functions == []
