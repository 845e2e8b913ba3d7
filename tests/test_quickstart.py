"""The quickstart does what docs/quickstart.md says: on CPU, GRPO raises the held-out reward by at least 0.2."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from conftest import QUICKSTART_TIMEOUT_S, quickstart

pytestmark = pytest.mark.learning


@pytest.mark.timeout(QUICKSTART_TIMEOUT_S)
def test_quickstart_raises_heldout_reward(quickstart_out):
    run = quickstart_out / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, 201))
    heldout = [m["eval/reward_mean"] for m in steps]
    first, last = sum(heldout[:10]) / 10, sum(heldout[-10:]) / 10
    # The bar: the last 10 steps at least 0.2 above the first 10 (rewards in [0, 1]). Measured (seed 0):
    # 0.29 -> 0.75 on a 2-core AMD EPYC with AVX-512 (docs/quickstart.md); other CPUs round the sums differently
    # and draw other trajectories (0.16 -> 0.57 seen on one), so 0.2 leaves room for them.
    assert last - first >= 0.2, (first, last)
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
    warm_start = json.loads((run / "warmup" / "megarl_checkpoint.json").read_text())
    assert 0 < warm_start["steps"] < 1500  # stopped by warmup.stop_answer_prob, not by the step limit


@pytest.mark.timeout(QUICKSTART_TIMEOUT_S)
def test_quickstart_hands_its_memory_over_every_step_and_resumes_from_a_checkpoint_written_after(quickstart_out,
                                                                                                  tmp_path):
    """Every step parks the trainer's state while the engine generates (the GPU order, on the CPU); the final
    checkpoint was written after such a step, and a run continued from it trains on."""
    run = quickstart_out / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the actor (no reference: kl_coef 0): fp32 parameters and gradients (4 + 4 bytes), Adam's moments (8)
    params = sum(t.numel() for t in load_file(str(quickstart_out / "model" / "model.safetensors")).values())
    assert all(m["handover/offloaded_bytes"] >= 16 * params for m in steps), steps[0]["handover/offloaded_bytes"]
    shutil.copytree(run, tmp_path / "run")  # the run of the other test stays as it is
    proc = quickstart(quickstart_out, "log.progress=false", "train.steps=202", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps][-3:] == [200, 201, 202]
