"""How megarl's modules depend on each other. The import graph has no cycle, and the package's rooms (its
subpackages and top-level modules) stand in one declared order, ROOMS, in which every import goes down: a
room imports only rooms before it, never one after it.

Every import counts, wherever it is written: at module level, inside a function (a lazy import is still a
dependency: a circle of them means two modules that cannot be understood, or split, apart) and under
`if TYPE_CHECKING:` (a module is not understood without the types it names). Relative imports are resolved.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"

# megarl's rooms (megarl/<room>/ or megarl/<room>.py; "megarl" is the package's own __init__), lowest first: a
# room imports only the rooms listed before it
ROOMS = (
    # foundations: no run, no model
    "megarl",          # the package: its version
    "dataclass_yaml",  # a YAML file onto a tree of frozen dataclasses, and back
    "algo",            # the math of advantages, losses and KL (pure tensor functions), and each algorithm's traits
    "config",          # the recipe's dataclasses and their checks
    "device",          # which device this process computes on
    "inject",          # faults injected on purpose (the recipe's `faults`): the fault matrix and the tests
    # the model and how a run lays it out
    "models",          # HF architectures, weight names and their tensor-parallel layouts
    "layout",          # the parallel layout of a job
    "job",             # a run resolved once: shapes, layout, the cast of models, the layer spec, the recipe checks
    "routing",         # MoE routes
    "plan",            # `megarl plan`: the memory of every GPU, estimated from the recipe and the model
    "ledger",          # a run's device memory counted against its plan
    # what a step carries and computes
    "batch",           # the rollout batch
    "packing",         # sequence packing and token balancing
    "data",            # prompt sets and supervised rows
    "objective",       # the recipe's algo section resolved into an estimator and losses
    # weights on disk and in transit
    "checkpoint",      # checkpoints and HF exports on disk
    "handoff",         # weight hand-off from trainer to rollout engine
    # what a run shows
    "timeline",        # per-rank step timelines and profiles
    "trackers",        # W&B and MLflow runs
    "metrics",         # timers, metrics.jsonl, console progress
    "report",          # `megarl report`: a run's charts and summary
    # the engines
    "engine",          # Megatron train engines
    "rollout",         # generation engines
    # what a sample meets
    "rewards",         # reward terms; a local judge generates with the native rollout engine
    "envs",            # environments, and the trajectories that take turns with them
    # what drives it all
    "loops",           # the training loops
    "cli",             # the `megarl` command
    "__main__",        # `python -m megarl`
)


@dataclass(frozen=True)
class Import:
    """One import of a megarl module by another, as written."""

    importer: str  # dotted name of the importing module
    target: str  # dotted name of the imported megarl module
    line: int
    text: str  # the statement

    def __str__(self) -> str:
        return f"{module_path(self.importer)}:{self.line} `{self.text}`"


def module_paths() -> dict[str, Path]:
    """Every module of the megarl package, by dotted name."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = module_paths()


def module_path(name: str) -> str:
    return str(MODULES[name].relative_to(PACKAGE.parent))


def room(name: str) -> str:
    """megarl.engine.lora -> engine; megarl.config -> config; megarl -> megarl."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def known_prefix(dotted: str) -> str | None:
    """The longest leading part of `dotted` that is a megarl module (a name imported from a module is not one)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def imports_of(name: str) -> list[Import]:
    """The megarl modules `name` imports anywhere in its body: module level, functions, TYPE_CHECKING blocks."""
    path = MODULES[name]
    source = path.read_text(encoding="utf-8")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [known_prefix(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from . import x`, `from ..config import y`: relative to this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from megarl.engine import cpu_compat` imports a module; `from megarl.config import Config` a name
            targets = [known_prefix(f"{base}.{alias.name}") or known_prefix(base) for alias in node.names]
        else:
            continue
        text = " ".join(ast.get_source_segment(source, node).split())
        found += [Import(name, target, node.lineno, text)
                  for target in dict.fromkeys(targets) if target is not None and target != name]
    return found


@functools.cache
def import_graph() -> dict[str, list[Import]]:
    return {name: imports_of(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports) as a path that ends where it starts."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    cycle = find_cycle({name: {i.target for i in imports} for name, imports in graph.items()})
    if cycle is not None:
        steps = [next(i for i in graph[a] if i.target == b) for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(map(str, steps)))


def test_the_cycle_finder_finds_a_cycle():
    # the check above must be able to fail: a lazy import back into an importer is a cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_room_has_its_place_in_the_order():
    rooms = sorted({room(name) for name in MODULES})
    unplaced = [f"{room_name} ({', '.join(module_path(n) for n in MODULES if room(n) == room_name)})"
                for room_name in rooms if room_name not in ROOMS]
    assert not unplaced, f"rooms missing from ROOMS (tests/test_structure.py): {'; '.join(unplaced)}"
    assert not set(ROOMS) - set(rooms), f"ROOMS names rooms megarl does not have: {sorted(set(ROOMS) - set(rooms))}"


def test_imports_go_down_the_rooms():
    rank = {name: k for k, name in enumerate(ROOMS)}
    upward = [f"{i}: {room(i.importer)} imports {room(i.target)} ({i.target}), which stands after it in ROOMS"
              for imports in import_graph().values() for i in imports
              if room(i.target) != room(i.importer) and rank.get(room(i.target), -1) > rank.get(room(i.importer), -1)]
    assert not upward, "\n".join(upward)


def test_the_import_reader_resolves_relative_and_lazy_imports(tmp_path, monkeypatch):
    # the checks above must see every kind of import: relative ones, those in functions and in TYPE_CHECKING
    package = tmp_path / "megarl"
    (package / "loops").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("")
    (package / "loops" / "__init__.py").write_text("")
    (package / "loops" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import b\nif TYPE_CHECKING:\n    from ..config import X\n"
        "def f():\n    import megarl.loops.b as c\n")
    (package / "loops" / "b.py").write_text("from .a import f\n")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    monkeypatch.setitem(globals(), "MODULES", module_paths())
    found = {(i.target, i.line) for i in imports_of("megarl.loops.a")}
    assert found == {("megarl.loops.b", 2), ("megarl.config", 4), ("megarl.loops.b", 6)}, found
    assert find_cycle({n: {i.target for i in imports_of(n)} for n in MODULES}) == [
        "megarl.loops.a", "megarl.loops.b", "megarl.loops.a"]


# (new home, name, old home): names that moved, and the modules they left
MOVED = [
    ("megarl.engine.roles", "BasePolicy", "megarl.engine.lora"),
    ("megarl.envs.trajectories", "run_trajectories", "megarl.rollout.multi_turn"),
    ("megarl.envs.trajectories", "Trajectory", "megarl.rollout.multi_turn"),
    ("megarl.envs.trajectories", "TrajectoryRun", "megarl.rollout.multi_turn"),
    ("megarl.envs.trajectories", "EnvWorkers", "megarl.rollout.multi_turn"),
    ("megarl.envs.trajectories", "FINISH_REASONS", "megarl.rollout.multi_turn"),
    ("megarl.envs.trajectories", "LIMITS", "megarl.rollout.multi_turn"),
    ("megarl.dataclass_yaml", "load_dataclass", "megarl.config"),
    ("megarl.dataclass_yaml", "ConfigError", "megarl.config"),
    ("megarl.dataclass_yaml", "FieldError", "megarl.config"),
    ("megarl.dataclass_yaml", "dump_config", "megarl.config"),
    ("megarl.dataclass_yaml", "config_to_dict", "megarl.config"),
    ("megarl.algo.traits", "ALGOS", "megarl.config"),
    ("megarl.algo.traits", "AlgoTraits", "megarl.config"),
    ("megarl.algo.traits", "AlgoName", "megarl.config"),
]


def defined_names(module: str) -> set[str]:
    """What a module defines at its top level (classes, functions, assignments), not what it imports."""
    names = set()
    for node in ast.parse(MODULES[module].read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            names.update(t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                         if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize("home, name, old", MOVED, ids=[f"{home}.{name}" for home, name, _ in MOVED])
def test_moved_names_live_in_their_new_homes(home, name, old):
    assert hasattr(importlib.import_module(home), name), f"`from {home} import {name}` fails"
    assert name in defined_names(home), f"{home} imports {name} instead of defining it"
    if old in MODULES:
        assert name not in defined_names(old), f"{old} still defines {name}, which moved to {home}"
    else:
        assert importlib.util.find_spec(old) is None, f"{old} is gone from megarl/ but still imports"


def algo_name_branches(module: str) -> list[ast.AST]:
    """The comparisons and matches of `module` on an algorithm's name (`cfg.algo.name`, AlgoConfig's `self.name`)."""
    found = []
    for top in ast.parse(MODULES[module].read_text(encoding="utf-8")).body:
        in_algo_config = isinstance(top, ast.ClassDef) and top.name == "AlgoConfig"
        for node in ast.walk(top):
            subjects = ([node.left, *node.comparators] if isinstance(node, ast.Compare)
                        else [node.subject] if isinstance(node, ast.Match) else [])
            names = [ast.unparse(s) for s in subjects]
            if any(n.split(".")[-2:] == ["algo", "name"] or in_algo_config and n == "self.name" for n in names):
                found.append(node)
    return found


def test_no_module_branches_on_the_algorithm_name():
    # what an algorithm is (its loop, estimator, models, data) is read from megarl.algo.traits.ALGOS, in one
    # table, not decided by comparisons of its name across the code; messages may still name it
    found = [f"{module_path(name)}:{node.lineno} `{ast.unparse(node).splitlines()[0]}`"
             for name in MODULES for node in algo_name_branches(name)]
    assert not found, "branches on algo.name (read AlgoConfig.traits instead):\n" + "\n".join(found)
