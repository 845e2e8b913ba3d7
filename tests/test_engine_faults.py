"""A rollout engine that does not sample the trainer's policy is caught, named, and stops the run: a push that
silently skips a tensor (the push checks of rollout.verify_weights), a push that never takes effect (the weight
version every generated token carries), an engine whose logprobs stay off the trainer's (the drift gate).

The engines are real (the native engine on the tiny Qwen2); each fault is a small wrapper around one. The push
checks run in this process; the version and drift checks in short `megarl train` runs
(tests/faulty_engines.py injects the fault there).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import QUICKSTART_TIMEOUT_S, REPO, from_warm_start, run_python
from faulty_engines import SkippingEngine
from megarl.handoff import WeightCheck, WeightMismatch, fingerprint, push_weights
from megarl.rollout.native import NativeEngine

PERIOD = 3  # rollout.verify_period of the sampled checks here


def trainer_pushes(model_dir: Path, count: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`count` pushes of every tensor of a checkpoint, with other values at every push (push p adds p * 1e-3),
    so a tensor an engine does not load keeps a value the trainer no longer has."""
    tensors = list(load_file(str(model_dir / "model.safetensors")).items())
    return [[(name, t + p * 1e-3) for name, t in tensors] for p in range(count)]


def push_all(engine, pushes, check: WeightCheck) -> list[int]:
    """Push each of `pushes` into `engine` with `check`'s selection; the tensors verified at each push."""
    return [push_weights(engine, iter(tensors), bucket_bytes=2**16, version=v, verify=check.select(v),
                         engine_name="rollout engine 0")["verified"] for v, tensors in enumerate(pushes, start=1)]


@pytest.fixture(scope="module")
def pushes(qwen2_other_dir):
    return trainer_pushes(qwen2_other_dir, 2 + PERIOD)


def test_fingerprints_match_equal_bytes_only():
    t = torch.randn(9_000_001, generator=torch.Generator().manual_seed(0))  # more than one chunk, a loose tail
    assert fingerprint(t).same(fingerprint(t.clone()))
    assert fingerprint(t.view(1, -1)).words == fingerprint(t).words  # the bytes, whatever the shape
    assert fingerprint(t[1:]).same(fingerprint(t[1:].clone()))  # an offset that is not a whole word
    swapped = t.clone()
    swapped[[0, 8_999_998]] = swapped[[8_999_998, 0]]  # the same half of an 8-byte word
    moved = fingerprint(swapped)
    assert moved.words == fingerprint(t).words and not moved.same(fingerprint(t))  # a moved value shows
    nudged = t.clone()
    nudged[123] = torch.nextafter(nudged[123], torch.tensor(1.0))  # one bit
    assert not fingerprint(nudged).same(fingerprint(t))
    half = t[:1000].to(torch.bfloat16)
    assert fingerprint(half).same(fingerprint(half.float().to(torch.bfloat16)))
    assert not fingerprint(half).same(fingerprint(t[:1000]))  # another dtype is another tensor


@pytest.mark.parametrize("mode", ["every", "first", "sampled"])
def test_a_push_that_skips_a_tensor_is_caught_on_that_push_naming_it(qwen2_dir, pushes, mode):
    """The run's first push checks every tensor in every mode but off (the engine starts from other weights,
    which the skipped tensor keeps)."""
    name = next(n for n, _ in pushes[0] if n.endswith("mlp.up_proj.weight"))
    engine = SkippingEngine(NativeEngine(str(qwen2_dir), device="cpu"), name=name, start=1)
    with pytest.raises(WeightMismatch, match=rf"version 1: rollout engine 0 holds another '{name}'") as caught:
        push_all(engine, pushes[:1], WeightCheck(mode, period=PERIOD))
    assert "engine float32" in str(caught.value) and "vs trainer float32" in str(caught.value)


def test_every_catches_a_skip_that_starts_later_on_that_push(qwen2_dir, pushes):
    name = pushes[0][-1][0]
    engine = SkippingEngine(NativeEngine(str(qwen2_dir), device="cpu"), name=name, start=3)
    with pytest.raises(WeightMismatch, match=rf"version 3: .* '{name}'"):
        push_all(engine, pushes, WeightCheck("every", period=PERIOD))


def test_sampled_catches_a_skip_that_starts_later_within_period_pushes(qwen2_dir, pushes):
    """After the first push, the push of version v checks the tensors at stream positions i = v (mod PERIOD): a
    skip of tensor i that starts at version 2 is found at the first v >= 2 with v = i (mod PERIOD); the tensor
    chosen is one the rotation reaches last, PERIOD pushes later."""
    index = next(i for i in range(len(pushes[0])) if i % PERIOD == 1)  # checked at versions 1, 4, 7, ...
    name = pushes[0][index][0]
    engine = SkippingEngine(NativeEngine(str(qwen2_dir), device="cpu"), name=name, start=2)
    with pytest.raises(WeightMismatch, match=rf"version {1 + PERIOD}: .* '{name}'"):
        push_all(engine, pushes, WeightCheck("sampled", period=PERIOD))


def test_the_same_pushes_with_nothing_skipped_pass_and_count_what_they_checked(qwen2_dir, pushes):
    n = len(pushes[0])
    counts = {mode: push_all(NativeEngine(str(qwen2_dir), device="cpu"), pushes, WeightCheck(mode, period=PERIOD))
              for mode in ("every", "first", "sampled", "off")}
    assert counts["every"] == [n] * len(pushes)
    assert counts["first"] == [n] + [0] * (len(pushes) - 1)
    assert counts["off"] == [0] * len(pushes)
    sampled = counts["sampled"]
    assert sampled[0] == n and sum(sampled[1: 1 + PERIOD]) == n  # every tensor once more within PERIOD pushes
    assert all(n // PERIOD <= c <= -(-n // PERIOD) for c in sampled[1:])


def test_an_engine_that_holds_the_weights_in_a_narrower_dtype_is_compared_in_its_dtype(qwen2_dir, pushes):
    """fp32 tensors pushed into a bf16 engine arrive rounded (an fp32 norm of a bf16 trainer): the check rounds
    the trainer's tensors as the engine's load does, and still tells a skipped one."""
    n = len(pushes[0])
    engine = NativeEngine(str(qwen2_dir), dtype="bfloat16", device="cpu")
    every = dict(bucket_bytes=2**16, verify=lambda index: True, dtype=torch.bfloat16, engine_name="rollout engine 0")
    assert push_weights(engine, iter(pushes[0]), version=1, **every)["verified"] == n
    name = next(n for n, _ in pushes[0] if n.endswith("self_attn.o_proj.weight"))
    with pytest.raises(WeightMismatch, match=rf"version 2: .* '{name}'"):
        push_weights(SkippingEngine(engine, name=name, start=1), iter(pushes[1]), version=2, **every)


def test_recipe_keys_of_the_checks(tmp_path):
    """`off` is a choice, not YAML 1.1's false; a bad value is an error naming the key."""
    from megarl.config import load_config
    from megarl.dataclass_yaml import ConfigError

    path = tmp_path / "q.yaml"
    path.write_text("model:\n  path: model\ndata:\n  train_path: train.jsonl\nrollout:\n  verify_weights: off\n")
    assert load_config(path, check_paths=False).rollout.verify_weights == "off"
    cfg = load_config(path, ["rollout.verify_weights=every", "rollout.max_logprob_drift=null"], check_paths=False)
    assert (cfg.rollout.verify_weights, cfg.rollout.max_logprob_drift) == ("every", None)
    for override, key in (("rollout.verify_weights=sometimes", "rollout.verify_weights"),
                          ("rollout.verify_period=0", "rollout.verify_period"),
                          ("rollout.max_logprob_drift=0", "rollout.max_logprob_drift"),
                          ("rollout.drift_patience=0", "rollout.drift_patience")):
        with pytest.raises(ConfigError, match=key):
            load_config(path, [override], check_paths=False)


# ---- faults a run stops at -----------------------------------------------------------------------------------
STEPS = 5
RUN_TIMEOUT_S = 240  # a 5-step tiny run takes ~15 s alone on 2 cores


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, qwen2_dir, arithmetic_dir) -> Path:
    """A tiny GRPO run whose weights move at every step: lr 1e-2 and an entropy bonus (the random model's
    responses all run to the length limit, so a length penalty alone gives every sample the same reward); the
    bonus also makes every sample train, so every step measures the drift. No evaluation, no checkpoint."""
    path = tmp_path_factory.mktemp("faults") / "recipe.yaml"
    path.write_text(
        f"model:\n  path: {qwen2_dir}\n"
        f"data:\n  train_path: {arithmetic_dir / 'train.jsonl'}\n  prompts_per_step: 4\n"
        "rollout:\n  n_samples: 4\n  max_new_tokens: 6\n"
        f"train:\n  steps: {STEPS}\n  micro_batch_size: 8\n"
        "algo:\n  name: grpo\n  entropy_coef: 0.01\n"
        "optim:\n  lr: 1.0e-2\n"
        "reward:\n  terms:\n    - {kind: length_penalty, max_tokens: 6, cache_tokens: 4}\n"
        "checkpoint:\n  every_steps: 0\n  save_final: false\n"
        "log:\n  progress: false\n"
    )
    return path


def faulty_run(recipe: Path, fault: str, *overrides: str, name: str | None = None,
               nproc: int = 0) -> tuple[int, str, list[dict]]:
    """`megarl train RECIPE` with a fault in its engine (tests/faulty_engines.py FAULT) in run_dir NAME (by
    default FAULT), on `nproc` torchrun ranks (0: one process, no torchrun): exit code, stderr and the metrics
    of the steps logged. A CrashingEngine logs its calls to NAME.calls.jsonl (`engine_calls`)."""
    run_dir = recipe.parent / (name or fault)
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    proc = run_python([*launch, str(REPO / "tests" / "faulty_engines.py"), fault, str(recipe), f"run_dir={run_dir}",
                       *overrides], cwd=recipe.parent, timeout_s=RUN_TIMEOUT_S,
                      env={"CRASH_LOG": f"{run_dir}.calls.jsonl"})
    metrics = run_dir / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return proc.returncode, proc.stderr, logged


def engine_calls(recipe: Path, name: str) -> list[dict]:
    """The generate calls a CrashingEngine run made, in order: call, crash, version, prompts."""
    return [json.loads(line) for line in (recipe.parent / f"{name}.calls.jsonl").read_text().splitlines()]


def test_a_push_that_never_takes_effect_stops_the_run_at_the_next_step_naming_engine_and_versions(recipe):
    """The engine keeps version 1 and its weights from the second push (after step 1) on: step 2's samples carry
    version 1 where the step expects 2. The push checks are off, which would otherwise catch it first."""
    code, err, logged = faulty_run(recipe, "ignored", "rollout.verify_weights=off")
    assert code == 1, err[-3000:]
    assert [m["step"] for m in logged] == [1]
    assert "megarl: rollout engine fault: step 2: rollout engine 0 generated with weight version 1; the step " \
           "expects version 2" in err, err[-3000:]
    assert "Traceback" not in err


def test_an_engine_off_the_trainers_policy_stops_the_run_within_drift_patience_steps(recipe):
    """The engine claims every pushed version but keeps the weights of the first push, so from step 2 on its
    logprobs are off the trainer's. The limit is 1e-3: far above an honest run's drift (step 1 here), far below
    what one stale update of this recipe gives. One step above it is a warning; the second in a row
    (drift_patience 2) stops the run."""
    code, err, logged = faulty_run(recipe, "claimed", "rollout.verify_weights=off", "rollout.max_logprob_drift=1e-3",
                                   "rollout.drift_patience=2")
    assert code == 1, err[-3000:]
    drift = [m["rollout/logprob_diff_mean"] for m in logged]
    assert len(logged) == 2 and all(m["rollout/logprob_diff_tokens"] > 0 for m in logged)
    assert drift[0] < 1e-5 < 1e-3 < drift[1]  # step 1 by the weights the trainer started from; step 2 stale
    stopped = len(logged) + 1
    assert "the rollout engines are not sampling the trainer's policy" in err, err[-3000:]
    assert f"step {stopped}: " in err
    assert "rollout.max_logprob_drift = 0.001 for 2 steps" in err
    assert err.count("is above rollout.max_logprob_drift") == 1  # the warning of the first step above


# ---- engines that fail and start again -------------------------------------------------------------------------
def test_an_engine_that_fails_midway_starts_again_and_its_step_goes_on_with_every_prompt_once(recipe):
    """The process's third generate call (step 3) hands out half its responses and raises, as a model forward
    that hits a device error would. The run starts the engine again, pushes it the current weights (version 3
    again, not a new one), generates step 3's samples once more and finishes every step."""
    code, err, logged = faulty_run(recipe, "crash:3")
    assert code == 0, err[-3000:]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert [m["rollout/engine_restarts"] for m in logged] == [0, 0, 1, 1, 1]
    assert [m["rollout/redispatched"] for m in logged] == [0, 0, 16, 16, 16]  # the step's samples, over the run
    calls = engine_calls(recipe, "crash:3")
    assert [(c["call"], c["crash"], c["version"]) for c in calls] == [
        (1, False, 1), (2, False, 2), (3, True, 3), (4, False, 3), (5, False, 4), (6, False, 5)]
    # the step's 16 samples (4 prompts x 4), all generated again on the new engine, none lost, none twice
    retried = collections.Counter(map(tuple, calls[3]["prompts"]))
    assert retried == collections.Counter(map(tuple, calls[2]["prompts"])) and sorted(retried.values()) == [4] * 4
    assert "restarting (restart 1 of at most 3): rollout engine 0: generate failed" in err
    assert "RuntimeError: simulated device failure in generate call 3" in err


def test_an_engine_that_leaves_a_prompt_unanswered_is_started_again_and_the_step_loses_no_sample(recipe):
    """The third generate call returns without a response for its last prompt and raises nothing: the run
    names the missing prompt, starts the engine again and generates step 3's samples once more; every step
    trains on all of its samples."""
    code, err, logged = faulty_run(recipe, "short:3")
    assert code == 0, err[-3000:]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert [m["rollout/engine_restarts"] for m in logged] == [0, 0, 1, 1, 1]
    assert "the engine returned 15 responses for 16 prompts (none for prompts [15])" in err, err[-3000:]
    calls = engine_calls(recipe, "short:3")
    assert [(c["call"], c["crash"], c["version"]) for c in calls][2:4] == [(3, True, 3), (4, False, 3)]
    retried = collections.Counter(map(tuple, calls[3]["prompts"]))  # all 16 samples of the step, again
    assert retried == collections.Counter(map(tuple, calls[2]["prompts"])) and sorted(retried.values()) == [4] * 4


def test_failures_past_max_engine_restarts_stop_the_run_with_a_checkpoint_that_gives_the_step_back(recipe):
    """Every generate call from the third on fails: the restart allowed (max_engine_restarts 1) fails too, and
    the run stops with exit code 1, naming the engine and its last error, after saving step 2 with the prompt
    sampler where step 2 left it. Resumed without the fault, step 3 draws the prompts the lost step drew."""
    code, err, logged = faulty_run(recipe, "crash:3+", "rollout.max_engine_restarts=1", name="lost")
    assert code == 1, err[-3000:]
    assert [m["step"] for m in logged] == [1, 2]
    assert ("megarl: rollout engine lost: rollout engine 0: generate failed after" in err
            and "RuntimeError: simulated device failure in generate call 4. That is failure 2 of a rollout engine "
                "in this run, past rollout.max_engine_restarts = 1 (checkpoint " in err), err[-3000:]
    assert "step00000002); to resume, run the same command" in err and "Traceback" not in err
    lost = engine_calls(recipe, "lost")
    assert [(c["call"], c["crash"]) for c in lost] == [(1, False), (2, False), (3, True), (4, True)]
    code, err, logged = faulty_run(recipe, "crash:1000", "rollout.max_engine_restarts=1", name="lost")
    assert code == 0, err[-3000:]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    resumed = engine_calls(recipe, "lost")[len(lost):]
    assert sorted(resumed[0]["prompts"]) == sorted(lost[2]["prompts"])  # step 3's prompts, drawn again


def test_an_engine_lost_in_the_evaluation_after_the_update_saves_the_step_it_trained(recipe, arithmetic_dir):
    """Held-out evaluation every 2 steps; every generate call from the third on fails (step 2's evaluation,
    after step 2's update and push), no restart allowed. The step has trained, so the run saves step 2 (its
    weights are step 2's) and stops with exit code 1."""
    code, err, logged = faulty_run(recipe, "crash:3+", "rollout.max_engine_restarts=0",
                                   f"data.eval_path={arithmetic_dir / 'heldout.jsonl'}",
                                   "data.eval_every=2", "data.eval_prompts=4", name="lost-in-eval")
    assert code == 1, err[-3000:]
    assert [m["step"] for m in logged] == [1]
    calls = engine_calls(recipe, "lost-in-eval")
    assert [(c["call"], c["crash"], len(c["prompts"])) for c in calls] == [(1, False, 16), (2, False, 16),
                                                                           (3, True, 4)]
    assert "past rollout.max_engine_restarts = 0 (checkpoint " in err and "step00000002); to resume" in err, \
        err[-3000:]


@pytest.mark.timeout(QUICKSTART_TIMEOUT_S)
def test_the_quickstart_through_an_engine_failure_computes_what_it_computes_without(quickstart_out, tmp_path):
    """The quickstart's GRPO from its warm start, 10 steps with the held-out reward every 2, once as it is and
    once with the engine failing midway in step 3's generation (its 4th call; step 2 evaluated). The restarted
    engine takes the current weights and the sampler state its predecessor had before the failed call, so it
    samples what that one would have: every step's metrics, held-out reward included, are the same numbers."""
    runs = {}
    for fault in ("crash:1000", "crash:4"):
        run_dir = tmp_path / fault
        proc = run_python([str(REPO / "tests" / "faulty_engines.py"), fault,
                           *from_warm_start(quickstart_out, run_dir, steps=10), "data.eval_every=2"],
                          timeout_s=QUICKSTART_TIMEOUT_S, env={"CRASH_LOG": f"{run_dir}.calls.jsonl"})
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[fault] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    clean, faulted = runs["crash:1000"], runs["crash:4"]
    assert [m["rollout/engine_restarts"] for m in faulted] == [0, 0] + [1] * 8
    assert [m["rollout/redispatched"] for m in faulted] == [0, 0] + [256] * 8  # step 3's samples, all again
    calls = [json.loads(line) for line in (tmp_path / "crash:4.calls.jsonl").read_text().splitlines()]
    assert [(c["call"], c["crash"], len(c["prompts"])) for c in calls[2:5]] == [(3, False, 64), (4, True, 256),
                                                                                (5, False, 256)]
    different = [(m["step"], key) for m, n in zip(faulted, clean) for key in m
                 if not key.startswith(("timing/", "throughput/"))
                 and key not in ("rollout/engine_restarts", "rollout/redispatched")
                 and m[key] != n[key]]
    assert len(faulted) == len(clean) == 10 and different == []
    assert [m["step"] for m in faulted if "eval/reward_mean" in m] == [2, 4, 6, 8, 10]


def test_a_rollout_worker_starts_its_failed_engine_again_with_the_last_push_it_received(recipe):
    """Placement split (one training rank, one rollout rank, max_staleness 1): the worker's third generate call
    (batch 3, generated by version 2) fails midway. The worker starts its engine again, gives it the push it
    kept on the host (version 2, so the batch stays within its staleness bound) and generates the batch's
    samples once more; the run finishes every step."""
    code, err, logged = faulty_run(recipe, "crash:3", "placement.mode=split", "placement.rollout_ranks=1",
                                   "algo.max_staleness=1", name="split", nproc=2)
    assert code == 0, err[-3000:]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    assert logged[-1]["rollout/engine_restarts"] == 1 and logged[-1]["rollout/redispatched"] == 16
    calls = engine_calls(recipe, "split")
    assert [(c["crash"], c["version"]) for c in calls[2:4]] == [(True, 2), (False, 2)]
    assert sorted(calls[3]["prompts"]) == sorted(calls[2]["prompts"]) and len(calls[3]["prompts"]) == 16
    assert "rollout worker 0: generate failed" in err and "restarting its engine (restart 1 of at most 3)" in err


def test_a_rollout_worker_past_max_engine_restarts_stops_the_run_with_a_checkpoint_that_keeps_its_batches(recipe):
    """Placement split as above, every generate call of the worker from the third on failing, one restart
    allowed: batch 3's generation fails twice and the worker is lost. It answers batch 3 (and batch 4, requested
    at step 3) with its error; the training ranks stop at step 3 with exit code 1 after saving step 2 with both
    batches' prompts. Resumed without the fault, the run requests both again, batch 3 first with the prompts
    the lost calls had, and finishes every step."""
    split = ("placement.mode=split", "placement.rollout_ranks=1", "algo.max_staleness=1",
             "rollout.max_engine_restarts=1")
    code, err, logged = faulty_run(recipe, "crash:3+", *split, name="split-lost", nproc=2)
    assert code == 1, err[-3000:]
    assert [m["step"] for m in logged] == [1, 2]
    assert ("megarl: rollout engine lost: rollout worker 0: generate failed after" in err
            and "simulated device failure in generate call 4. That is failure 2 of its engine in this run, past "
                "rollout.max_engine_restarts = 1 (checkpoint " in err
            and "step00000002); to resume, run the same command" in err), err[-3000:]
    lost = engine_calls(recipe, "split-lost")
    assert [(c["call"], c["crash"]) for c in lost] == [(1, False), (2, False), (3, True), (4, True)]
    code, err, logged = faulty_run(recipe, "crash:1000", *split, name="split-lost", nproc=2)
    assert code == 0, err[-3000:]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))
    resumed = engine_calls(recipe, "split-lost")[len(lost):]
    assert sorted(resumed[0]["prompts"]) == sorted(lost[2]["prompts"]) and len(resumed[0]["prompts"]) == 16
    assert len(resumed) == STEPS - 2 + 1  # batches 3, 4 again, then 5 and 6 (max_staleness 1 asks one ahead)
