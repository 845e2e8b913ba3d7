"""Every tiny RL recipe under recipes/ runs on CPU and does what its algorithm is for: the reward rises.

Each recipe starts from the quickstart's supervised warm start (copied, so it is trained once per session)
and runs 60 of its 100 steps on fresh prompts (the learning rate is constant after its warmup, so these are
the recipe's first 60 steps exactly). The objective measured is the mean reward of the step's samples: each
step draws 64 prompts never trained on before (3,840 of a 20,000-prompt pool), so it measures the policy on
new problems, over 256 samples a step (a 10-step mean has a standard error of about 0.01).
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import QUICKSTART_TIMEOUT_S, REPO, from_warm_start, quickstart, run_python

pytestmark = pytest.mark.learning

STEPS = 60  # of the recipes' 100: what the bar below needs (measured there)
RECIPE_TIMEOUT_S = 600  # about 25-45 s each on 2 free cores

# The critic's explained variance of the returns over the last 10 steps, measured 0.03-0.11 (0.074 over steps
# 51-60 at one thread): a sampled answer is right or wrong mostly by chance at this skill level, so most return
# variance cannot be predicted. A constant (or untrained) critic scores 0; the bar is well above that and well
# below the measurement.
EXPLAINED_VAR_MIN = 0.02

RECIPES = ["ppo_tiny", "grpo_tiny", "dr_grpo_tiny", "dapo_tiny", "gspo_tiny", "reinforce_pp_tiny", "rloo_tiny"]


def run_recipe(out, name: str) -> list[dict]:
    (out / name).mkdir(exist_ok=True)
    shutil.copytree(out / "run" / "warmup", out / name / "warmup", dirs_exist_ok=True)
    proc = quickstart(out, "--recipe", str(REPO / "recipes" / f"{name}.yaml"), f"train.steps={STEPS}",
                      "log.progress=false", "checkpoint.save_final=false", timeout_s=RECIPE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.mark.timeout(QUICKSTART_TIMEOUT_S + RECIPE_TIMEOUT_S)
@pytest.mark.parametrize("name", RECIPES)
def test_tiny_recipe_raises_reward(quickstart_out, name):
    steps = run_recipe(quickstart_out, name)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    # dynamic sampling keeps only groups with mixed rewards; the policy's own reward is measured before that
    key = "sampling/reward_mean" if name == "dapo_tiny" else "reward/mean"
    first = mean(m[key] for m in steps[:10])
    last = mean(m[key] for m in steps[-10:])
    # Measured over 60 steps at one thread on a 2-core Xeon (a warm start of 478 steps): a rise of 0.142
    # (dr_grpo) to 0.181 (dapo) for every recipe (ppo 0.173, grpo 0.146, gspo 0.165, reinforce_pp 0.172, rloo
    # 0.155), while grpo with optim.lr=1e-12 (learning nothing) drifted 0.023. Over 100 steps they rose 0.22
    # to 0.35 on a 2-core AVX-512 machine. (At torch's default two threads, which conftest.py now rules out,
    # grpo and rloo once rose less than 0.08 in 60 steps.) 0.08 is about half the smallest 60-step rise and
    # six standard errors of the difference (about 0.013) above zero: room for another CPU's trajectory, none
    # for a recipe that does not learn.
    assert last - first >= 0.08, (first, last)
    if name == "ppo_tiny":
        # the critic starts at V = 0 (explained variance exactly 0) and learns to predict the returns
        assert steps[0]["critic/explained_var"] == pytest.approx(0.0, abs=1e-6)
        explained = mean(m["critic/explained_var"] for m in steps[-10:])
        assert explained >= EXPLAINED_VAR_MIN, [m["critic/explained_var"] for m in steps]
        assert all(m["kl/coef"] > 0 for m in steps)
    if name == "dapo_tiny":
        assert all(0 < m["sampling/kept_group_frac"] <= 1 for m in steps)
        assert any(m["sampling/rounds"] > 1 for m in steps)  # some steps drew more prompts


@pytest.mark.timeout(QUICKSTART_TIMEOUT_S + 2 * RECIPE_TIMEOUT_S)
def test_skipping_zero_advantage_samples_leaves_the_update_as_it_was(quickstart_out):
    """From the warm start, where groups earn mixed rewards, GRPO trains only on the samples with a non-zero
    advantage (`train.skip_zero_advantage`, on by default). The first step with and without skipping samples
    the same responses from the same weights and has the same loss and gradient norm: 1e-6, the same fp32
    math in micro-batches of other sizes."""
    runs = {}
    for skip in ("true", "false"):
        run_dir = quickstart_out / f"skip_{skip}"
        shutil.copytree(quickstart_out / "run" / "warmup", run_dir / "warmup", dirs_exist_ok=True)
        proc = quickstart(quickstart_out, f"run_dir={run_dir}", "train.steps=2", f"train.skip_zero_advantage={skip}",
                          "data.eval_path=null", "log.progress=false", "checkpoint.save_final=false",
                          timeout_s=RECIPE_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[skip] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skipping, every = runs["true"][0], runs["false"][0]
    assert 0.0 < skipping["train/trained_frac"] < 1.0 and every["train/trained_frac"] == 1.0
    assert skipping["reward/mean"] == every["reward/mean"]
    assert skipping["grad_norm"] > 0
    assert skipping["loss"] == pytest.approx(every["loss"], abs=1e-6)
    assert skipping["grad_norm"] == pytest.approx(every["grad_norm"], rel=1e-6)


@pytest.mark.timeout(QUICKSTART_TIMEOUT_S + 2 * RECIPE_TIMEOUT_S)
def test_lora_recipe_raises_reward_from_its_base(quickstart_out):
    """recipes/lora_tiny.yaml (rank-8 adapters, the base frozen, KL to the base through the adapters-off actor)
    over 100 steps. Measured at one thread on a busy 2-core machine (a warm start of 503 steps): reward 0.233 over
    the first 10 steps, 0.376 over steps 91-100 (a rise of 0.143; 0.067 after 60 steps, which is why this runs
    100); held-out reward 0.180 -> 0.428 over 200 steps (docs/lora.md). The bar is half the measured rise."""
    name = "lora_tiny"
    (quickstart_out / name).mkdir(exist_ok=True)
    shutil.copytree(quickstart_out / "run" / "warmup", quickstart_out / name / "warmup", dirs_exist_ok=True)
    proc = quickstart(quickstart_out, "--recipe", str(REPO / "recipes" / f"{name}.yaml"), "train.steps=100",
                      "log.progress=false", "checkpoint.save_final=false", timeout_s=2 * RECIPE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (quickstart_out / name / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["kl"] == 0.0  # fresh adapters: the policy is its reference exactly
    assert mean(m["kl"] for m in steps[-10:]) > 0
    rise = mean(m["reward/mean"] for m in steps[-10:]) - mean(m["reward/mean"] for m in steps[:10])
    assert rise >= 0.07, rise


@pytest.mark.timeout(QUICKSTART_TIMEOUT_S + 2 * RECIPE_TIMEOUT_S)
def test_lora_adapter_sync_computes_what_merged_sync_computes(quickstart_out, tmp_path):
    """recipes/lora_tiny.yaml from the warm start, its adapters handed to the native engine alone
    (rollout.lora_sync: adapter), which merges them as the trainer merges (W + (alpha / rank) B A, the product
    in fp32): the engine then holds the weights a merged push gives it, so both runs sample the same responses
    and compute the same step, while the push carries the adapters' bytes only. Rewards are compared exactly
    (the same samples); loss and gradient norm within 1e-6 (the same fp32 math; a product computed in a
    differently shaped matrix may round its last bit otherwise). Measured: equal to the last digit over 3 steps,
    131 KiB pushed instead of 1.2 MiB."""
    runs = {}
    for sync in ("merged", "adapter"):
        run_dir = tmp_path / sync
        proc = run_python(["-m", "megarl", "train", str(REPO / "recipes" / "lora_tiny.yaml"),
                           *from_warm_start(quickstart_out, run_dir, steps=3)[1:], f"rollout.lora_sync={sync}",
                           "data.eval_path=null"], timeout_s=RECIPE_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[sync] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(runs["merged"]) == len(runs["adapter"]) == 3
    for merged, adapter in zip(runs["merged"], runs["adapter"], strict=True):
        assert adapter["reward/mean"] == merged["reward/mean"]
        assert adapter["loss"] == pytest.approx(merged["loss"], abs=1e-6)
        assert adapter["grad_norm"] == pytest.approx(merged["grad_norm"], rel=1e-6)
        assert adapter["rollout/logprob_diff_max"] == pytest.approx(merged["rollout/logprob_diff_max"], abs=1e-6)
        assert adapter["handoff/bytes"] < merged["handoff/bytes"] / 5
    assert runs["adapter"][-1]["kl"] > 0  # the adapters moved the policy off its base
