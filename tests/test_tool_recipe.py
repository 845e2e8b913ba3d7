"""The calculator-tool recipes end to end on CPU: a tiny tool-chat model is warm-started on demonstrations
(recipes/tool_calc_sft_tiny.yaml: half call the calculator, half guess), then GRPO with the calculator
environment (recipes/tool_calc_tiny.yaml) makes it use the tool and so raises its reward.

About 2.5 min of SFT (packed rows) and under a minute of RL on 2 busy cores; the SFT is what takes long (the
copying skill appears after about 200 steps; a warm start stopped there leaves RL a model that calls the tool
but rarely copies its result, so the recipe trains 400).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, run_python, subprocess_env

pytestmark = pytest.mark.learning

TIMEOUT_S = 900


def megarl_train(recipe: str, *overrides: str, cwd) -> None:
    proc = subprocess.run([sys.executable, "-m", "megarl", "train", str(REPO / "recipes" / recipe), *overrides,
                           "log.progress=false"], cwd=cwd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory) -> list[dict]:
    """Metrics of the two recipes run as their header says, in a fresh directory."""
    out = tmp_path_factory.mktemp("tools")
    made = run_python([str(REPO / "tools" / "make_tiny_model.py"), "--out", str(out / "runs/tools/model"),
                       "--tool-chat", "--hidden", "128", "--heads", "8", "--kv-heads", "4", "--ffn", "256"])
    assert made.returncode == 0, made.stderr
    data = run_python(["-m", "megarl.data.multiplication", "--out", str(out / "runs/tools/data")])
    assert data.returncode == 0, data.stderr
    megarl_train("tool_calc_sft_tiny.yaml", cwd=out)
    megarl_train("tool_calc_tiny.yaml", "checkpoint.save_final=false", cwd=out)
    return [json.loads(line) for line in (out / "runs/tools/rl/metrics.jsonl").read_text().splitlines()]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_tool_recipe_runs_multi_turn_rollouts_through_the_trainer(tool_run):
    assert [m["step"] for m in tool_run] == list(range(1, 31))
    for m in tool_run:
        ended = [v for k, v in m.items() if k.startswith("env/ended_by/")]
        assert len(ended) == 6 and sum(ended) == pytest.approx(1.0)
        assert 1.0 <= m["env/turns_mean"] <= 3.0  # env.max_turns
        # the trainer scores the generated tokens of multi-turn trajectories as the engine sampled them
        assert m["rollout/logprob_diff_max"] < 1e-3
    assert mean(m["env/turns_mean"] for m in tool_run[-10:]) > 1.5  # most trajectories call the tool


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_rl_raises_tool_use_and_reward(tool_run):
    # Measured over 30 steps (16 prompts x 4 samples each, drawn from 4,368 training problems, so mostly new
    # ones): tool calls per trajectory 0.73 (first 10 steps) -> 1.01 (last 10); reward 0.66 -> 0.94 (0.69 ->
    # 1.01 and 0.66 -> 0.95 with an earlier trainer's per-parameter Adam). (With demonstrations 30% of which
    # call the tool, another CPU measured 0.66 -> 1.00 and 0.54 -> 0.88, and this one a warm start that had not
    # learned to copy: reward 0.03 -> 0.04.)
    calls_first, calls_last = (mean(m["env/tool_calls_mean"] for m in w) for w in (tool_run[:10], tool_run[-10:]))
    reward_first, reward_last = (mean(m["reward/mean"] for m in w) for w in (tool_run[:10], tool_run[-10:]))
    # Well under the measured rises (tool calls 0.28-0.32, reward 0.28-0.29). A 10-step reward mean over 640
    # samples at p ~ 0.5 has a standard error of about 0.02, so 0.15 is five standard errors of the difference
    # above zero.
    assert calls_last - calls_first >= 0.2, (calls_first, calls_last)
    assert reward_last - reward_first >= 0.15, (reward_first, reward_last)
    # Held out (64 problems never trained on, nor their mirror images), evaluated at steps 5 ... 30: tool
    # calls measured 0.88 -> 1.00 (0.81 -> 1.00 with the earlier trainer, 0.75 -> 1.02 on the other CPU). The
    # standard error of each rate is at most 0.0625, so a rise of 0.1 is above zero and below the measured
    # 0.125-0.27; the first evaluation, already near one call per problem, leaves the least room.
    evals = [m for m in tool_run if "eval/tool_calls_mean" in m]
    assert [m["step"] for m in evals] == [5, 10, 15, 20, 25, 30]
    assert evals[-1]["eval/tool_calls_mean"] - evals[0]["eval/tool_calls_mean"] >= 0.1, evals
