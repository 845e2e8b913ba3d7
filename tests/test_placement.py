"""megarl.rollout.placement: a rollout engine on every group of `rollout.tp` ranks, whatever the trainer's layout,
so every device generates; the exchange groups that pool prompts and results; and, under torchrun on gloo
ranks, RL runs whose every engine generates and receives every weight after every update (its logprobs equal
the trainer's, <= 1e-4 in fp32: the same function on the same weights)."""

from __future__ import annotations

import math

import pytest

from conftest import run_python
from megarl.rollout.placement import exchange_groups


def test_exchange_groups_are_replicas_when_engines_nest_inside_them():
    # TP=2 innermost, DP=2: replicas {0,1} and {2,3}; one engine per rank, or one per replica
    replicas = [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert exchange_groups(replicas, rollout_tp=1) == [(0, 1), (2, 3)]
    assert exchange_groups(replicas, rollout_tp=2) == [(0, 1), (2, 3)]
    assert exchange_groups([(0,), (1,)], rollout_tp=1) == [(0,), (1,)]  # data parallel only: each rank alone


def test_an_engine_that_spans_replicas_joins_them():
    # PP=2 with DP=2: stage 0 is ranks 0 and 1, so replica 0 is {0, 2} and replica 1 is {1, 3}
    replicas = [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert exchange_groups(replicas, rollout_tp=1) == [(0, 2), (1, 3)]
    assert exchange_groups(replicas, rollout_tp=2) == [(0, 1, 2, 3)]  # engine {0,1} and engine {2,3} link both
    # data parallel only, engines of two ranks: each engine's two replicas form one group
    assert exchange_groups([(0,), (1,), (2,), (3,)], rollout_tp=2) == [(0, 1), (2, 3)]


ENGINE_RUN_TIMEOUT_S = 420  # 2-4 gloo ranks of a tiny model on 2 cores, a few steps


def run_rl(tmp_path, qwen2_dir, arithmetic_dir, *, nproc: int, overrides: tuple[str, ...]) -> list[dict]:
    from test_cli import read_metrics, write_recipe

    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir)
    # An entropy bonus moves the weights every step even while rewards are all 0, so every push after an
    # update carries new weights that a stale engine would not have.
    proc = run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "megarl",
                       "train", str(recipe), "train.steps=3", "warmup.sft_steps=0", "algo.entropy_coef=0.1",
                       "optim.lr=1e-3", "checkpoint.save_final=false", *overrides], timeout_s=ENGINE_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(run_dir)


@pytest.mark.timeout(2 * ENGINE_RUN_TIMEOUT_S)
@pytest.mark.parametrize("nproc, overrides, engines", [
    (2, ("parallel.pp=2",), 2),                               # both pipeline stages generate
    (2, ("parallel.tp=2",), 2),                               # both tensor-parallel ranks generate
    (2, ("parallel.pp=2", "rollout.tp=2"), 1),                # one engine over both ranks
    (4, ("parallel.pp=2", "rollout.tp=2", "algo.name=dapo", "algo.max_sampling_rounds=2"), 2),
], ids=["pp2", "tp2", "pp2-rollout_tp2", "dp2pp2-rollout_tp2-dapo"])
def test_every_engine_generates_and_gets_every_update(tmp_path, qwen2_dir, arithmetic_dir, nproc, overrides,
                                                      engines):
    records = run_rl(tmp_path, qwen2_dir, arithmetic_dir, nproc=nproc, overrides=overrides)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["rollout/engines"] == engines, record
        assert record["rollout/logprob_diff_max"] <= 1e-4, record
        assert record["grad_norm"] > 0 and math.isfinite(record["loss"]), record


@pytest.mark.timeout(ENGINE_RUN_TIMEOUT_S)
def test_an_expert_parallel_moe_model_runs_an_engine_per_rank(tmp_path, arch_dir, arithmetic_dir):
    # EP = 2: each rank holds half the experts; each engine must receive all of them after every update
    records = run_rl(tmp_path, arch_dir("qwen2_moe"), arithmetic_dir, nproc=2, overrides=("parallel.ep=2",))
    for record in records:
        assert record["rollout/engines"] == 2, record
        assert record["rollout/logprob_diff_max"] <= 1e-4, record
