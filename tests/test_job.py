"""A run is resolved once (megarl.job): the Job alone reads checkpoint shapes and decides which models a run has,
and what launch, the loops, the engine builder and `megarl plan` know of a run comes from it.

- for every recipe in recipes/, the models `megarl plan` counts are the Job's cast, and for the recipes that run
  here the engines the loop builds are too, in its order;
- the recipe as written is not changed by launch (what launch resolves is `run_dir/job.yaml`);
- the rules of the code: `read_shape(` only in megarl/job.py; no module of megarl/engine imports the recipe
  (`Config`) or raises a recipe error; the rank arithmetic of the rollout engines (`% rollout.tp`,
  `// rollout.tp`) only in megarl/layout.py; no `global` state in megarl/engine.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "megarl"
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
# the recipes whose models are built here (the others' checkpoints are a cluster's): RL, DPO and RM loops
BUILT_HERE = [p for p in RECIPES if p.parent.name == "recipes" and ("tiny" in p.stem or p.stem == "quickstart")
              and "sft" not in p.stem]


def sources(folder: Path = PACKAGE) -> list[Path]:
    return sorted(folder.rglob("*.py"))


# ---- the rules of the code -----------------------------------------------------------------------------------
def test_only_the_job_reads_a_checkpoints_shape():
    readers = [str(p.relative_to(REPO)) for p in sources() if "read_shape(" in p.read_text()]
    assert readers == ["megarl/job.py", "megarl/models/arch.py"], readers  # the one call, and the definition


def test_the_engine_package_takes_resolved_values_and_raises_no_recipe_error():
    offenders = []
    for path in sources(PACKAGE / "engine"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "megarl.config":
                offenders += [f"{path.name}: imports {a.name}" for a in node.names if a.name in ("Config", "RecipeError")]
            if isinstance(node, ast.Raise) and node.exc is not None:
                raised = ast.unparse(node.exc.func if isinstance(node.exc, ast.Call) else node.exc)
                if raised.endswith(("RecipeError", "LayoutError", "ConfigError")):
                    offenders.append(f"{path.name}:{node.lineno}: raises {raised}")
            if isinstance(node, ast.Global):
                offenders.append(f"{path.name}:{node.lineno}: global {', '.join(node.names)}")
    assert not offenders, offenders


def test_the_rollout_engines_rank_arithmetic_lives_in_the_layout():
    """Which rank hosts which engine is worked out in megarl/layout.py alone. megarl/config.py checks that the
    recipe's own placement.rollout_ranks is a multiple of rollout.tp: a key the recipe alone decides."""
    rule = re.compile(r"(%|//)\s*\(?\s*(self\.|cfg\.|job\.cfg\.)?(rollout\.tp|rollout_tp)\b")
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in sources() if p.name not in ("layout.py", "config.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if rule.search(line)]
    assert not found, found


# ---- launch leaves the recipe as written ---------------------------------------------------------------------------
def test_launch_resolves_without_writing_into_the_recipe(qwen2_dir, tmp_path):
    """train.share_prompts needs RoPE unfused: the engines get it from the Job, the recipe stays as written, and
    job.yaml says what was resolved."""
    import yaml

    from megarl.config import load_config
    from megarl.loops.launch import resolve_job

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{path: {qwen2_dir}, lora: {{rank: 4}}}}\ndata: {{train_path: unused.jsonl}}\n"
                      "train: {micro_batch_tokens: 256, share_prompts: true}\nalgo: {kl_coef: 0.01}\n")
    cfg = load_config(recipe, check_paths=False)
    before = dataclasses.asdict(cfg)
    job = resolve_job(cfg)
    assert dataclasses.asdict(cfg) == before and cfg.model.megatron == {}
    assert job.megatron == {"apply_rope_fusion": False} and not job.te_layers
    saved = yaml.safe_load(yaml.safe_dump(job.resolved()))
    assert saved["megatron"] == {"apply_rope_fusion": False} and saved["layer_spec"] == "local"
    assert [(m["name"], m["trainable"], m["shares_actor"]) for m in saved["models"]] == [
        ("actor", True, False), ("reference", False, True)]


# ---- the cast ------------------------------------------------------------------------------------------------------
def planned_cluster(recipe: Path, cfg) -> tuple[list[str], Path | None]:
    """`megarl plan`'s --nodes/--gpus-per-node/--model-config from the recipe's header, where it has one."""
    for line in recipe.read_text().splitlines()[:12]:
        if "megarl plan" in line:
            args = shlex.split(line.split("megarl plan", 1)[1])
            config = args[args.index("--model-config") + 1] if "--model-config" in args else None
            return args, (REPO / config) if config else None
    return [], None


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_plan_counts_the_models_of_the_cast(recipe, qwen2_dir):
    from megarl.config import load_config
    from megarl.models.arch import read_shape
    from megarl.plan import Cluster, plan

    cfg = load_config(recipe, check_paths=False)
    args, config = planned_cluster(recipe, cfg)
    if args:
        nodes, gpus = int(args[args.index("--nodes") + 1]), int(args[args.index("--gpus-per-node") + 1])
        shape = read_shape((config or Path(cfg.model.path) / "config.json").parent)
    else:  # a tiny recipe: one rank, the tiny model
        nodes, gpus, shape = 1, cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp, read_shape(qwen2_dir)
    planned = plan(cfg, shape, Cluster(nodes, gpus))
    cast = planned.job.cast
    own = [r for r in cast if not r.shares_actor]
    assert [m.name for m in planned.models] == [
        r.name if r.trainable or r.name != "reward_model" else f"reward_model ({r.key.removesuffix('.path')})"
        for r in sorted(own, key=lambda r: r.name == "reward_model" and not r.trainable)]
    # what the recipe asks for, read from its own keys
    expected = {"sft": ["actor"], "dpo": ["actor", "reference"], "rm": ["reward_model"]}.get(cfg.algo.name)
    if expected is None:
        expected = ["actor"] + ["reference"] * (cfg.algo.kl_coef > 0) + ["teacher"] * (cfg.teacher.path is not None) \
            + ["critic"] * (cfg.algo.name == "ppo") + ["reward_model" for t in cfg.reward.terms if t.kind == "reward_model"]
    assert [r.name for r in cast] == expected
    assert all(r.shares_actor == (r.name == "reference" and cfg.model.lora is not None) for r in cast)


@pytest.fixture(scope="module")
def tool_chat_dir(tmp_path_factory):
    """A random tiny tool-chat model, for the recipes whose environment calls tools."""
    from conftest import _tiny_model_tool

    return _tiny_model_tool().make_tiny_model(tmp_path_factory.mktemp("tool_chat"), tool_chat=True, seed=3)


def on_tiny_models(cfg, model: Path):
    """`cfg` with every checkpoint it names replaced by the tiny `model` (a critic from the policy's)."""
    terms = type(cfg.reward.terms)(dataclasses.replace(t, path=str(model)) if t.kind == "reward_model" else t
                                   for t in cfg.reward.terms)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=str(model)),
        teacher=dataclasses.replace(cfg.teacher, path=str(model) if cfg.teacher.path else None),
        critic=dataclasses.replace(cfg.critic, path=None), reward=dataclasses.replace(cfg.reward, terms=terms),
        warmup=dataclasses.replace(cfg.warmup, sft_steps=0), data=dataclasses.replace(cfg.data, eval_path=None))


@pytest.mark.parametrize("recipe", BUILT_HERE, ids=lambda p: p.stem)
def test_the_loop_builds_the_cast_in_its_order(recipe, qwen2_dir, tool_chat_dir, tiny_data, groups, monkeypatch):
    from transformers import AutoTokenizer

    from megarl.config import load_config
    from megarl.engine import roles
    from megarl.job import Job

    cfg = load_config(recipe, check_paths=False)
    model = tool_chat_dir if cfg.env.name != "single_turn" else qwen2_dir
    job = Job.of(on_tiny_models(cfg, model), world=1, ranks_per_node=1)
    built, make = [], roles.make_engine
    monkeypatch.setattr(roles, "make_engine", lambda role, *a, **k: built.append(role.name) or make(role, *a, **k))
    match cfg.algo.name:
        case "dpo" | "rm":
            from megarl.loops.dpo import build_run as dpo_run
            from megarl.loops.rm import build_run as rm_run

            pairs = dataclasses.replace(job.cfg.data, train_path=str(tiny_data / "train_pairs.jsonl"))
            (dpo_run if cfg.algo.name == "dpo" else rm_run)(
                dataclasses.replace(job, cfg=dataclasses.replace(job.cfg, data=pairs)), groups)
        case _:
            from megarl.data.prompts import PromptRow
            from megarl.loops.colocated import ColocatedRollouts
            from megarl.loops.rl_run import build_run

            run = build_run(job, groups, rollouts=ColocatedRollouts(job, groups),
                            tokenizer=AutoTokenizer.from_pretrained(model), train_rows=[PromptRow("1+1=", "2", index=0)],
                            eval_rows=[])
            run.rollouts.close()
            run.scorer.close()
    assert built == [r.name for r in job.cast if not r.shares_actor]
