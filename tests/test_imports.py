"""How megarl's modules import each other: none of them loads a heavy backend at import time (STYLE 6: those
are imported lazily, inside the functions that drive them), and the import graph has no cycle, counting
imports inside functions too (a lazy import is still a dependency: a circle of them means two modules
that cannot be understood, or split, apart)."""

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
                       "megarl.engine.lora_layers", "megarl.engine.te_attention")
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


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The megarl modules `path` imports anywhere in its body (module level or inside functions), except
    under `if TYPE_CHECKING:`, which never runs."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_checking = [branch for branch in ast.walk(tree)
                     if isinstance(branch, ast.If) and ast.unparse(branch.test).endswith("TYPE_CHECKING")]
    skipped = {id(node) for branch in type_checking for stmt in branch.body for node in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from megarl.engine import cpu_compat` imports a module; `from megarl.config import X` a name
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names)
    return {name for name in found if name in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports) as a path that ends where it starts."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    modules = set(module_names())
    graph = {}
    for name in modules:
        path = PACKAGE.parent / Path(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        graph[name] = imported_modules(path, modules) - {name}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    # the check above must be able to fail: a lazy import back into an importer is a cycle
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


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
