"""Process groups wait `parallel.timeout_minutes` in a collective (every group: the world, Megatron's and
megarl's own), and an error raised while a step waits names the phase it was in. The world megarl starts on a
GPU serves the loops' host-side bookkeeping beside NCCL's device tensors: RL steps run on two ranks in it (SFT and
DPO in their own tests), emulated on the CPU where NCCL's part refuses host tensors as NCCL does."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import REPO, in_gpu_world, run_python

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
    from megarl.config import load_config
    from megarl.dataclass_yaml import ConfigError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\ndata:\n  train_path: t.jsonl\nparallel:\n  timeout_minutes: 90\n")
    assert load_config(recipe, check_paths=False).parallel.timeout_minutes == 90
    with pytest.raises(ConfigError, match="parallel.timeout_minutes"):
        load_config(recipe, ["parallel.timeout_minutes=0"], check_paths=False)


# ---- the world of a GPU run, emulated on the CPU (tests/gpu_world_worker.py) --------------------------------
RUN_TIMEOUT_S = 240  # each run below takes ~20-40 s on 2 busy cores


def gpu_world(*args: str, cwd) -> subprocess.CompletedProcess:
    return run_python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(REPO / "tests" / "gpu_world_worker.py"), *args], cwd=cwd, timeout_s=RUN_TIMEOUT_S)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_the_emulated_nccl_world_refuses_host_tensors_and_megarls_gpu_world_serves_them(tmp_path):
    """The control for the runs below: NCCL's devices alone (what a world started as "nccl" has) refuse the
    loops' host-side counts, as NCCL does on a GPU; the world megarl starts on a GPU sums them."""
    refused = gpu_world("nccl", "sums", cwd=tmp_path)
    assert refused.returncode != 0
    assert refused.stdout.count("refused: No backend type associated with device type cpu") == 2, refused.stdout
    served = gpu_world("megarl", "sums", cwd=tmp_path)
    assert served.returncode == 0, served.stderr[-3000:]
    assert served.stdout.count("sums [2.0, 1.0]") == 2


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_the_nodes_of_an_engine_learn_where_they_meet_before_any_device_communicator(tmp_path):
    """An SGLang engine over two nodes (here one rank each): the host hands its node part the address the nodes'
    schedulers meet at as a host tensor, which the world of a GPU run serves beside NCCL's device tensors without
    making an NCCL communicator (SGLang has not sized its memory yet)."""
    proc = gpu_world("megarl", "nodes", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = sorted(re.findall(r"rank (\d) node part (\w+) meets at (\S+)", proc.stdout))
    # rank 0 hosts the engine (node 0); rank 1 starts SGLang's part on node 1
    assert [(rank, part) for rank, part, _ in said] == [("0", "None"), ("1", "1")], proc.stdout
    (_, _, first), (_, _, second) = said
    assert first == second and re.fullmatch(r"[\d.]+:\d+", first), proc.stdout


def rl_recipe(path, *, model_dir, data_dir):
    """PPO with a critic (whitened advantages), a reference model, dynamic sampling (the ranks decide
    together whether to sample again) and a checkpoint every step: every host-side collective of the loop."""
    path.write_text(
        f"model:\n  path: {model_dir}\n"
        f"data:\n  train_path: {data_dir / 'train.jsonl'}\n  eval_path: {data_dir / 'heldout.jsonl'}\n"
        "  prompts_per_step: 4\n  eval_prompts: 4\n  eval_every: 1\n"
        "rollout:\n  n_samples: 2\n  max_new_tokens: 4\n  tp: 2\n"
        "train:\n  steps: 2\n  micro_batch_size: 2\n"
        "algo:\n  name: ppo\n  kl_coef: 0.05\n  dynamic_sampling: true\n  max_sampling_rounds: 2\n"
        "reward:\n  terms:\n    - {kind: length_penalty, max_tokens: 4, cache_tokens: 3}\n"
        "checkpoint:\n  every_steps: 1\n"
        "log:\n  progress: false\n")
    return path


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_rl_steps_run_on_two_ranks_in_the_world_megarl_starts_on_a_gpu(qwen2_dir, arithmetic_dir, tmp_path):
    """Two data-parallel ranks (and one rollout engine over both), so every bookkeeping collective of the RL
    loop runs over more than one rank: counts, sums, balancing, flags, objects, checkpoints. SFT and DPO run
    in this world in their data-parallel tests (tests/test_sft.py, tests/test_dpo.py)."""
    recipe = rl_recipe(tmp_path / "ppo.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir)
    proc = run_python([*in_gpu_world(2), "train", str(recipe), f"run_dir={tmp_path / 'rl'}"], cwd=tmp_path,
                      timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
