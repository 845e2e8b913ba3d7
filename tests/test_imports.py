"""STYLE 6: the package, the math, the config, the batch, the handoff, the loop and the engine modules
import none of the heavy backends; those are imported lazily, inside the functions that drive them."""

from __future__ import annotations

import pytest

from conftest import run_python

HEAVY = ("megatron", "sglang", "transformer_engine", "apex", "ray")
LIGHT_MODULES = (
    "megarl", "megarl.config", "megarl.algo.advantages", "megarl.algo.aggregate", "megarl.algo.kl",
    "megarl.algo.losses", "megarl.batch", "megarl.handoff", "megarl.metrics", "megarl.cli", "megarl.checkpoint",
    "megarl.data.prompts", "megarl.data.arithmetic", "megarl.data.math_word", "megarl.rewards.exact",
    "megarl.rewards.math_answer", "megarl.rewards.shaping", "megarl.rewards.sandbox", "megarl.rewards.scorer",
    "megarl.rewards.pool", "megarl.models.arch",
    "megarl.models.names", "megarl.models.layout", "megarl.rollout.native", "megarl.engine.cpu_compat",
    "megarl.engine.megatron", "megarl.loops.rl",
    "megarl.data.supervised", "megarl.loops.supervised", "megarl.loops.sft", "megarl.loops.dpo",
    "megarl.loops.launch", "megarl.loops.resume", "megarl.rollout.sglang_engine", "megarl.engine.offload",
    "megarl.packing", "megarl.plan", "megarl.data.multiplication", "megarl.envs.documents",
    "megarl.envs.environment", "megarl.envs.tool_format", "megarl.envs.tools", "megarl.models.safetensors_dir",
    "megarl.rollout.multi_turn",
)


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
