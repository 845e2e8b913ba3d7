"""What a run survives, as tools/fault_matrix.py measures it: its short form (--quick) runs here, each fault
launched through launch/torchrun.sh on 2 ranks and compared with the fault-free run. Every fault of the quick
form recovers exactly: the final weights bit for bit and every logged number but timings equal the fault-free
run's, no prompt lost or trained twice. The injection itself (the recipe's `faults`) is checked too: a fault
fires once per run, on the rank it names."""

from __future__ import annotations

import json
import math

import pytest

from conftest import REPO, run_python
from megarl.config import load_config
from megarl.dataclass_yaml import ConfigError

MATRIX_TIMEOUT_S = 900  # --quick: 8 runs of ~15 s each, and the restarts (torchrun's teardown waits up to 30 s)


@pytest.fixture(scope="module")
def quick_matrix(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("fault_matrix")
    proc = run_python([str(REPO / "tools" / "fault_matrix.py"), "--quick", "--out", str(out)],
                      timeout_s=MATRIX_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    rows = json.loads((out / "fault_matrix.json").read_text())
    assert (out / "fault_matrix.md").read_text().count("\n") == len(rows) + 2
    return {row["fault"]: row for row in rows}


@pytest.mark.timeout(MATRIX_TIMEOUT_S)
@pytest.mark.parametrize("fault, outcome, detected_within_s", [
    # the engine is started again and given the step's weights; the step's samples are generated once more
    ("native engine dies mid-generate", "recovered in place", 1.0),
    # placement split: the training rank's push to the dead rollout rank fails in step 2 (its batch 3 was being
    # generated ahead), so the job starts again from step 1's checkpoint
    ("rollout rank killed (split)", "resumed from step 1 (restarted by launch/torchrun.sh)", 5.0),
    # the other rank sees the connection reset at once, torchrun stops it and launch/torchrun.sh starts both
    # again; they resume from step 2's checkpoint
    ("trainer rank killed mid-step", "resumed from step 2 (restarted by launch/torchrun.sh)", 5.0),
    # killed in step 4 without restarts; step 3's checkpoint cut short; launched again, the run sets it aside
    ("checkpoint damaged at resume", "resumed from step 2 (launched again, as a requeue)", 60.0),
    # the step finishes and is saved, the rank exits 143; torchrun sees a failed process, and launch/torchrun.sh
    # (not itself asked to stop) starts the job again, which goes on from step 3
    ("SIGTERM during a push", "resumed from step 3 (restarted by launch/torchrun.sh)", 5.0),
])
def test_the_quick_matrix_recovers_each_fault_exactly(quick_matrix, fault, outcome, detected_within_s):
    row = quick_matrix[fault]
    assert row["outcome"] == outcome, row
    assert row["exact"], row["differs"]
    assert (row["prompts_lost"], row["prompts_repeated"], row["samples_lost"], row["samples_failed"]) == (0, 0, 0, 0)
    assert row["detected_s"] is not None and row["detected_s"] <= detected_within_s, row


def test_fault_keys_are_checked(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: model\ndata:\n  train_path: train.jsonl\n")
    cfg = load_config(recipe, ["faults=[{kind: kill, step: 3, phase: train, rank: 1}]"], check_paths=False)
    assert (cfg.faults[0].kind, cfg.faults[0].step, cfg.faults[0].phase, cfg.faults[0].rank) == ("kill", 3, "train", 1)
    assert load_config(recipe, check_paths=False).faults == []
    for override, message in (("faults=[{kind: meteor, step: 3}]", "faults"),
                              ("faults=[{kind: kill, step: 0}]", "step"),
                              ("faults=[{kind: kill, step: 1, phase: lunch}]", "phase"),
                              ("faults=[{kind: reward_kill, step: 1}]", "reward.workers")):
        with pytest.raises(ConfigError, match=message):
            load_config(recipe, [override], check_paths=False)


def test_a_fault_fires_once_per_run_on_the_rank_it_names(tmp_path):
    """A process that arms the recipe's faults again (torchrun started it again) finds the marks of those that
    fired and goes on without them; a fault for another rank never fires here."""
    from megarl import inject
    from megarl.config import FaultConfig

    faults = [FaultConfig(kind="nan", step=2), FaultConfig(kind="nan", step=3, rank=1)]
    inject.arm(faults, rank=0, run_dir=str(tmp_path))
    fired = []
    for step in (1, 2, 3):
        inject.enter_step(step)
        fired.append(math.isnan(inject.poison(1.0)))
    assert fired == [False, True, False]
    inject.arm(faults, rank=0, run_dir=str(tmp_path))  # the same run, started again
    inject.enter_step(2)
    assert inject.poison(1.0) == 1.0
    inject.arm([], rank=0, run_dir=str(tmp_path))
