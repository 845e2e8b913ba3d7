"""The GPU memory choreography of a colocated run, all of it on the CPU (DESIGN contracts 7 and 9):

- a rollout engine that releases its weights really frees them, comes back with garbage (NaN) and cannot
  generate until a full push fills them; an engine that takes a LoRA policy's adapters alone keeps its base
  weights, and a run of that mode with an engine that releases them (an earlier megarl's order) stops;
- the device-memory ledger counts each phase as `megarl plan` plans it (within 5%, the plan's fixed reserve
  left out of both: it is one constant, the same on both sides) and fails a phase over the plan's peak, naming
  the phase and what holds the memory;
- the drift (rollout/logprob_diff) covers every sample of a step, also those the update skips;
- the final export onloads the parameters alone.
The final export beside a resumed SGLang engine, which only SGLang's pool makes too large, is in
tests/test_sglang_runs.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, run_python

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 2
SAMPLE = dict(temperature=1.0, top_p=1.0, max_new_tokens=8, eos_id=2, pad_id=0)
RUN_TIMEOUT_S = 240
RESERVE = 4 * 2**30  # megarl.plan.memory.RESERVE_GIB, in every phase of plan and ledger alike


def test_a_released_engine_holds_nothing_and_generates_nothing_until_a_full_push(qwen2_dir):
    from megarl.rollout.engine import EngineError
    from megarl.rollout.native import NativeEngine

    engine = NativeEngine(str(qwen2_dir), seed=3, device="cpu")
    fresh = NativeEngine(str(qwen2_dir), seed=3, device="cpu")
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    assert engine.release_memory() == engine.weight_bytes == sum(
        s.nbytes() for s in {p.untyped_storage()._cdata: p.untyped_storage() for p in weights.values()}.values())
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())  # really freed
    assert engine.device_bytes()["weights"] == 0
    with pytest.raises(EngineError, match="still released"):
        engine.generate(PROMPTS, **SAMPLE)
    engine.resume_weights()
    assert all(torch.isnan(p).all() for p in engine.model.parameters())  # garbage, as a GPU's resumed pages
    with pytest.raises(EngineError, match="no full weight push"):
        engine.generate(PROMPTS, **SAMPLE)
    engine.update_weights([list(weights.items())], version=1)
    got, want = engine.generate(PROMPTS, **SAMPLE), fresh.generate(PROMPTS, **SAMPLE)
    assert got.response_ids == want.response_ids and got.logprobs == want.logprobs


def test_an_engine_that_takes_adapters_alone_keeps_its_base_weights(qwen2_dir):
    from megarl.rollout.native import NativeEngine

    engine = NativeEngine(str(qwen2_dir), seed=3, device="cpu", keep_weights=True)
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.generate(PROMPTS, **SAMPLE)
    assert engine.device_bytes()["kv_cache"] > 0
    assert engine.release_memory() == 0  # its generation's KV cache went when the generation returned
    assert engine.device_bytes() == {"weights": engine.weight_bytes, "kv_cache": 0}
    engine.resume_weights()
    assert all(torch.equal(p, before[name]) for name, p in engine.model.named_parameters())
    engine.generate(PROMPTS, **SAMPLE)


def lora_args(model: str, data: str, run_dir) -> list[str]:
    return [str(REPO / "recipes" / "lora_tiny.yaml"), f"run_dir={run_dir}", f"model.path={model}",
            f"data.train_path={data}/train.jsonl", "data.eval_path=null", "warmup.sft_steps=0", "train.steps=2",
            "log.progress=false", "rollout.lora_sync=adapter", "checkpoint.save_final=false"]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_adapters_over_released_base_weights_stop_the_run_and_kept_ones_train(qwen2_dir, arithmetic_dir, tmp_path):
    """rollout.lora_sync: adapter. In an earlier megarl the engines released their base weights with the KV cache
    and only the adapters were pushed back, so on a GPU they generated from garbage from step 1. That order
    (tests/order_worker.py) now stops the run naming the cause; the engine that keeps its base weights trains."""
    old = run_python(["tests/order_worker.py", "adapters-over-released",
                      *lora_args(qwen2_dir, arithmetic_dir, tmp_path / "old")[0:],
                      "rollout.max_engine_restarts=0"], timeout_s=RUN_TIMEOUT_S)
    assert old.returncode != 0
    assert "a push of the adapters alone does not restore the base weights" in old.stderr, old.stderr[-3000:]
    fixed = run_python(["-m", "megarl", "train", *lora_args(qwen2_dir, arithmetic_dir, tmp_path / "fixed")],
                       timeout_s=RUN_TIMEOUT_S)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "fixed" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/released_bytes"] == 0  # the base weights stay; a generation's KV cache goes with it
        assert m["rollout/logprob_diff_max"] <= 1e-4


@pytest.fixture(scope="module")
def native_run(qwen2_dir, arithmetic_dir, tmp_path_factory):
    """The quickstart's GRPO from the random tiny model for 2 steps (no warm start: every reward is 0, so no
    sample trains), a checkpoint after step 1 and the final export; each weight push is logged
    (tests/order_worker.py log-pushes)."""
    run_dir = tmp_path_factory.mktemp("native_run")
    pushes = run_dir / "pushes.jsonl"
    proc = run_python(["tests/order_worker.py", "log-pushes", str(REPO / "recipes" / "quickstart.yaml"),
                       f"run_dir={run_dir}",
                       f"model.path={qwen2_dir}", f"data.train_path={arithmetic_dir / 'train.jsonl'}",
                       "data.eval_path=null", "warmup.sft_steps=0", "train.steps=2", "checkpoint.every_steps=1",
                       "log.progress=false"], timeout_s=RUN_TIMEOUT_S, env={"PUSH_LOG": str(pushes)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_checkpoint_costs_no_weight_push(native_run):
    """The periodic checkpoint is written inside the step's own residency, between the update and the push: the
    weights go to the engines once at the start and once per step, each version once (an earlier megarl pushed
    the whole model again after every checkpoint: two pushes of the same weights)."""
    run_dir, _ = native_run
    pushes = [json.loads(line) for line in (run_dir / "pushes.jsonl").read_text().splitlines()]
    assert pushes == [{"version": 1, "step": None}, {"version": 2, "step": 1}, {"version": 3, "step": 2}]
    saved = json.loads((run_dir / "checkpoints" / "step00000001" / "state.json").read_text())
    assert saved["weight_version"] == 2  # the saved weights are the ones pushed as version 2


def test_the_ledger_counts_each_phase_as_the_plan_plans_it(native_run, qwen2_dir):
    """Planned and counted peaks of train, push and rollout agree within 5% (measured: within 512 bytes of
    about 1-10 MB; the rest is DDP's padding, which the plan leaves out); the engine gives back its weights."""
    from megarl.rollout.native import NativeEngine

    _, steps = native_run
    last = steps[-1]
    for phase in ("train", "push", "rollout"):
        planned = last[f"memory/peak_planned_bytes/{phase}"] - RESERVE
        counted = last[f"memory/peak_counted_bytes/{phase}"] - RESERVE
        assert planned > 0 and abs(counted - planned) <= 0.05 * planned, (phase, planned, counted)
    weights = NativeEngine(str(qwen2_dir), device="cpu").weight_bytes
    assert all(m["rollout/released_bytes"] == weights for m in steps)


def test_the_drift_covers_every_sample_also_when_none_trains(native_run):
    """A random model earns no reward: every advantage is 0 and the update skips every sample, yet the drift is
    measured over every response token (the gate would otherwise read nothing)."""
    _, steps = native_run
    samples = 64 * 4  # data.prompts_per_step x rollout.n_samples
    for m in steps:
        assert m["train/trained_frac"] == 0.0
        assert m["rollout/logprob_diff_tokens"] == pytest.approx(m["response/len_mean"] * samples)
        assert m["rollout/logprob_diff_max"] <= 1e-4


def test_a_phase_over_the_plan_fails_naming_the_phase_and_its_owners():
    from megarl.ledger import DeviceLedger, MemoryOverPlan

    class Plan:  # the two figures a ledger reads of megarl.plan.estimate.Plan
        phases = {"train": RESERVE + 1000, "rollout": RESERVE + 400}
        peak = RESERVE + 1000

    ledger = DeviceLedger(replan=lambda prompt_tokens: Plan, padding=10, activations=lambda seq_len: 0)
    ledger.count("rollout", {"rollout engine weights": 300, "rollout engine kv cache": 100})
    ledger.count("export", {"actor parameters": 500, "rollout engine weights": 300, "actor optimizer state": 210})
    ledger.check()  # 1010 <= 1000 + 10
    ledger.count("export", {"actor parameters": 500, "rollout engine weights": 300, "actor optimizer state": 211})
    with pytest.raises(MemoryOverPlan, match=r"phase 'export'.*actor parameters.*rollout engine weights.*optimizer"):
        ledger.check()
    assert ledger.counted == {"rollout": RESERVE + 400, "export": RESERVE + 1011}
    assert ledger.metrics() == {"memory/peak_planned_bytes/train": RESERVE + 1000,
                                "memory/peak_planned_bytes/rollout": RESERVE + 400,
                                "memory/peak_counted_bytes/rollout": RESERVE + 400}


def test_the_export_onloads_the_parameters_alone(qwen2_dir, groups):
    from megarl.config import OptimConfig
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    engine = TrainEngine(model_dir=str(qwen2_dir), shape=read_shape(str(qwen2_dir)), dtype="float32", megatron={}, groups=groups,
                         optim=OptimConfig(lr=1e-3))
    resident = engine.memory.resident_bytes()
    engine.offload_training_state()
    engine.offload_params()
    assert engine.memory.resident_bytes() == {"params": 0, "grads": 0, "optim": 0}
    # exact host buffers: the bytes parked, no power-of-two rounding
    assert engine.memory.host_bytes == resident["params"] + resident["optim"]
    engine.onload(params_only=True)
    assert engine.memory.resident_bytes() == {"params": resident["params"], "grads": 0, "optim": 0}
    engine.onload()
    assert engine.memory.resident_bytes() == resident


def test_a_run_megarl_plan_cannot_bound_goes_on_without_the_ledger_saying_why(arithmetic_dir, tmp_path):
    """A multi-turn environment without env.max_tokens has no length bound to plan for (megarl plan refuses it):
    the run trains without a device-memory ledger and says so."""
    model = tmp_path / "model"
    made = run_python([str(REPO / "tools" / "make_tiny_model.py"), "--out", str(model), "--tool-chat"])
    assert made.returncode == 0, made.stderr
    run_dir = tmp_path / "run"
    proc = run_python(["-m", "megarl", "train", str(REPO / "recipes" / "quickstart.yaml"), f"run_dir={run_dir}",
                       f"model.path={model}", f"data.train_path={arithmetic_dir / 'train.jsonl'}",
                       "data.eval_path=null", "data.chat_template=true", "data.prompts_per_step=4",
                       "train.micro_batch_size=16",
                       "env.name=envs_for_tests:CountingEnv", "env.max_turns=2", "warmup.sft_steps=0",
                       "train.steps=1", "checkpoint.save_final=false", "log.progress=false"],
                      cwd=REPO / "tests", timeout_s=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the device-memory ledger is off for this run: megarl plan cannot plan it: env.max_tokens is null" \
        in proc.stderr
    step, = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("memory/") for key in step) and step["rollout/released_bytes"] > 0
