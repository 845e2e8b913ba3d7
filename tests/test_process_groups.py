"""Process groups wait `parallel.timeout_minutes` in a collective (every group: the world, Megatron's and
megarl's own), and an error raised while a step waits names the phase it was in."""

from __future__ import annotations

import pytest

from conftest import run_python

# Rank 1 is late by far more than the timeout; rank 0 waits for it in the "generate" phase's collective.
WORKER = """
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.engine.parallel import init_parallel
from megarl.metrics import PhaseTimer
from megarl.rollout.placement import place_rollout

groups = init_parallel(tp=1, pp=2, timeout=timedelta(seconds=TIMEOUT_S))
place = place_rollout(rollout_tp=2, replica=groups.mp, timeout=groups.timeout)
assert place.exchange is not None and groups.timeout == timedelta(seconds=TIMEOUT_S)
timer = PhaseTimer()
with timer("generate"):
    if dist.get_rank() == 1:
        time.sleep(60)
    for group in (None, groups.pp, place.exchange):  # the world's, Megatron's and an exchange group
        dist.all_reduce(torch.ones(1), group=group)
print("no timeout")
"""


@pytest.mark.timeout(180)
def test_a_collective_times_out_after_the_configured_wait_naming_the_phase(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("TIMEOUT_S", "5"))
    proc = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
                      timeout_s=150)
    assert proc.returncode != 0
    assert "no timeout" not in proc.stdout
    assert "megarl: raised in the 'generate' phase of the step" in proc.stderr, proc.stderr[-3000:]


def test_the_recipe_key_is_checked(tmp_path):
    from megarl.config import ConfigError, load_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\ndata:\n  train_path: t.jsonl\nparallel:\n  timeout_minutes: 90\n")
    assert load_config(recipe, check_paths=False).parallel.timeout_minutes == 90
    with pytest.raises(ConfigError, match="parallel.timeout_minutes"):
        load_config(recipe, ["parallel.timeout_minutes=0"], check_paths=False)
