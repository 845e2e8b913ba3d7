"""The real SGLang engine (CPU mode here) against the Megatron trainer: weight push, logprob parity, the loop.

These run in the SGLang environment (SGLang pins its own torch; see the README's SGLang test command).
Each check runs in a subprocess, because an exception in SGLang's scheduler kills the whole process tree.
"""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_python

pytest.importorskip("sglang", reason="SGLang environment not installed (README: SGLang tests)")

SGLANG_TIMEOUT_S = 600  # engine start-up is 15-35 s on 2 cores; a hang fails instead of stalling CI


@pytest.fixture(scope="module")
def push_result(qwen2_dir, qwen2_other_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang") / "result.json"
    proc = run_python([str(REPO / "tests" / "sglang_worker.py"), "--trainer-model", str(qwen2_dir),
                       "--other-model", str(qwen2_other_dir), "--out", str(out)], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_engine_serves_its_checkpoint_before_a_push(push_result):
    # SGLang and transformers compute the same fp32 function: 1e-4 is the DESIGN bound (measured ~5e-7).
    assert push_result["before_vs_other_hf"] <= 1e-4
    assert push_result["before_vs_trainer"] > 1e-2  # the two models differ, so the next check can fail


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_after_a_push_sglang_logprobs_equal_the_trainers(push_result):
    assert push_result["push"]["buckets"] >= 5  # many small buckets, every tensor delivered
    assert push_result["after_vs_trainer"] <= 1e-4
    assert push_result["weight_version"] == 1
    assert push_result["logprob_lens_match"]
    assert set(push_result["finish_reasons"]) <= {"stop", "length"}
    for ids, reason in zip(push_result["response_ids"], push_result["finish_reasons"]):
        assert 1 <= len(ids) <= 8
        assert (reason == "stop") == (ids[-1] == 0)  # a stopped response ends with its EOS token


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_pushing_a_second_models_weights_reproduces_that_model(push_result):
    assert push_result["second_push_vs_other_hf"] <= 1e-4


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_a_push_with_an_unknown_tensor_name_fails_loudly(push_result):
    assert push_result["bad_push_error"] is not None
    assert "model.layers.0.no_such.weight" in push_result["bad_push_error"]


@pytest.mark.timeout(SGLANG_TIMEOUT_S)
def test_rl_loop_with_sglang_rollouts(qwen2_dir, arithmetic_dir, tmp_path):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
run_dir: {run_dir}
model: {{path: {qwen2_dir}}}
data: {{train_path: {arithmetic_dir / 'train.jsonl'}, eval_path: {arithmetic_dir / 'heldout.jsonl'},
        prompts_per_step: 4, eval_prompts: 8}}
rollout: {{engine: sglang, n_samples: 4, max_new_tokens: 4}}
algo: {{kl_coef: 0.01}}
optim: {{lr: 1.0e-4}}
train: {{steps: 2, micro_batch_size: 8}}
log: {{progress: false}}
""")
    proc = run_python(["-m", "megarl", "train", str(recipe)], timeout_s=SGLANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        # The step's rollout logprobs came from SGLang, the old logprobs from Megatron, after a push.
        assert m["rollout/logprob_diff_max"] <= 1e-4
        assert m["timing/push_s"] > 0 and m["handoff/bytes"] > 0
