"""The GPU check of megarl's own stack (native rollout engine, Megatron's local layer spec), in at most
TOTAL_S seconds on one GPU, run by tools/device_check/run.sh after it installed the carried wheels:

1. preflight: versions, the device, its free memory;
2. engine tests on CUDA (tests/test_engine.py): logits and logprobs equal transformers' in fp32 (1e-4) for
   every architecture, bf16 parity (tolerances in the test: Megatron's error against fp32 at most twice
   transformers' own bf16 error, and within 0.1 mean / 0.6 max nats of transformers in bf16), the HF round
   trip, the weight push, micro-batch invariance, trainer offload and onload (memory drops, the same bytes
   come back; tests/test_handover.py: every storage freed, the next update the same to the bit, the pinned
   host buffers reused), the MoE router without Transformer Engine (tests/test_gpu_paths.py); MoE routing replay (tests/test_router_replay.py: forced routes equal transformers', the native
   engine's routes give its logprobs, recording, recompute); no test may be skipped;
3. a bf16 GRPO quickstart under `torchrun --nproc_per_node=1` with the native engine: every step offloads
   the trainer, pushes the weights on the device and onloads it again; the run saves a checkpoint and a
   second run resumes from it for one more step;
4. two ranks on the one GPU (tools/device_check/two_ranks.py): data-parallel GRPO with one rollout engine
   for both ranks, so gradients, counts and generated samples cross ranks as CUDA and host tensors;
5. tools/bench_train.py at a 1B shape: MFU against the H200's 790 TFLOP/s bf16, and the peak memory of a
   step against `megarl plan`'s estimate for the same layout (parameters, gradients, optimizer state and
   activations of the policy model);
6. tools/bench_handoff.py on CUDA: the weight push against a device-to-device copy of the same tensors.

    python tools/device_check/check.py --out DIR [--dry-run]

--dry-run runs the same stages on the CPU with tiny shapes (fp32, fewer steps), so the wiring is proven
without a GPU; nothing in it is a measurement. DIR receives device_check.json (rewritten after every stage),
device_check.txt (the table it prints) and each stage's output as DIR/<stage>.log, and nothing else: the
machine returns at most 8 files from it. Models, runs, caches and pytest's files go to a scratch folder
under the system's temporary directory, removed at the end. Exits 1 when a stage failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The whole check; run.sh installs the wheels before it, within the machine's 600 s per command.
TOTAL_S = 480
# Each stage's time, all its processes together. Their sum stays under TOTAL_S, so a stage that runs to its
# budget takes no time from the stages after it; what is left covers the check's own bookkeeping.
BUDGET_S = dict(preflight=10, engine_tests=100, grpo_quickstart=110, two_ranks=80, bench_train=100,
                bench_handoff=40)
H200_BF16_TFLOPS = 790.0  # dense bf16 matrix products measured on the lent H200 (8192^3, random data)


class Check:
    """The stages' shared state: where output goes, the deadline, and the results so far."""

    def __init__(self, out: Path, work: Path, *, dry_run: bool):
        self.out, self.work, self.dry_run = out, work, dry_run
        self.deadline = time.monotonic() + TOTAL_S
        self.stage_deadline = self.deadline
        self.stages: dict[str, dict] = {}

    def begin(self, stage: str) -> None:
        self.stage_deadline = min(time.monotonic() + BUDGET_S[stage], self.deadline)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1", MEGARL_CACHE=str(self.work / "cache"))
        return env

    def run(self, stage: str, argv: list[str], *, stdout: Path | None = None) -> subprocess.Popen | None:
        """`argv` with its output in OUT/<stage>.log (its stdout in `stdout` if given), bounded by what is
        left of the stage's budget; None (and the stage marked as timed out) when it ran past."""
        timeout = max(1.0, self.stage_deadline - time.monotonic())
        log = self.out / f"{stage}.log"
        with log.open("a") as f, (stdout.open("w") if stdout else f) as out:
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            # In its own process group, ended whole when it returns or runs past: a worker that torchrun
            # left behind would hold the GPU through the stages after it.
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env(), stdout=out, stderr=f, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
                return proc
            except subprocess.TimeoutExpired:
                f.write(f"\n[ran past {timeout:.0f} s]\n")
                self.stages[stage] = dict(status="timeout", detail=f"ran past {timeout:.0f} s")
                return None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def python(self, stage: str, args: list[str], *, stdout: Path | None = None) -> subprocess.Popen | None:
        return self.run(stage, [sys.executable, *args], stdout=stdout)


def failed(check: Check, stage: str, proc: subprocess.Popen | None, what: str) -> bool:
    """Mark `stage` failed when its process did not exit 0; True when it did not."""
    if proc is None:
        return True
    if proc.returncode != 0:
        tail = (check.out / f"{stage}.log").read_text().strip().splitlines()[-1:] or [""]
        check.stages[stage] = dict(status="failed", detail=f"{what} exited {proc.returncode}: {tail[0][:200]}")
        return True
    return False


# ---- 1 ---------------------------------------------------------------------------------------------------
def preflight(check: Check) -> None:
    import importlib.metadata as md

    import torch

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                **{dist: version(dist) for dist in ("transformers", "megatron-core", "megarl")})
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info |= dict(device=torch.cuda.get_device_name(), free_gib=free / 2**30, total_gib=total / 2**30)
    elif not check.dry_run:
        check.stages["preflight"] = dict(status="failed", detail="no CUDA device visible to torch", **info)
        return
    else:
        info["device"] = "cpu (dry run)"
    check.stages["preflight"] = dict(status="ok", **info)


# ---- 2 ---------------------------------------------------------------------------------------------------
ENGINE_TESTS = ("gpu_ or equal_transformers or bit_exact or push_makes or invariant_to_micro_batch or "
                # MoE routing replay on the device: forced routes, the engine's routes, recording, recompute
                "replays_given or engines_routes or r2_records or recomputed or "
                # the hand-over on CUDA storage and pinned host buffers; the MoE router without Transformer Engine
                "offload_frees or frozen_model_offloads or router_runs_without")
ENGINE_TESTS_DRY = "gpu_ or (equal_transformers and qwen2 and not moe) or frozen_model_offloads"


def engine_tests(check: Check) -> None:
    junit = check.work / "engine_tests.xml"
    args = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--basetemp={check.work / 'pytest'}",
            f"--junitxml={junit}", "tests/test_engine.py", "tests/test_router_replay.py", "tests/test_handover.py",
            "tests/test_gpu_paths.py",
            "-k", ENGINE_TESTS_DRY if check.dry_run else ENGINE_TESTS]
    proc = check.python("engine_tests", args)
    if proc is None:
        return
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in counts}
    gpu_tests_skipped = counts["skipped"] > 0 and not check.dry_run
    ok = proc.returncode == 0 and counts["tests"] > 0 and not gpu_tests_skipped
    detail = (f"{counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']} passed, "
              f"{counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped")
    check.stages["engine_tests"] = dict(status="ok" if ok else "failed", detail=detail, **counts)


# ---- 3 ---------------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tiny_run(check: Check, stage: str, run_dir: Path) -> list[str] | None:
    """The overrides of recipes/quickstart.yaml for a short run in `run_dir` on a tiny Qwen2 model and the
    arithmetic data, both made once in the scratch folder; None (and `stage` failed) when they could not be."""
    model, data = check.work / "tiny_model", check.work / "arithmetic"
    if not (model / "config.json").is_file():
        made = check.python(stage, ["tools/make_tiny_model.py", "--out", str(model), "--hidden", "128",
                                    "--layers", "2", "--heads", "8", "--kv-heads", "4", "--ffn", "256"])
        if failed(check, stage, made, "make_tiny_model"):
            return None
    if not (data / "train.jsonl").is_file():
        made = check.python(stage, ["-m", "megarl.data.arithmetic", "--out", str(data)])
        if failed(check, stage, made, "megarl.data.arithmetic"):
            return None
    overrides = [f"run_dir={run_dir}", f"model.path={model}",
                 "model.dtype=" + ("float32" if check.dry_run else "bfloat16"),
                 f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'heldout.jsonl'}",
                 "rollout.engine=native", "log.progress=false"]
    if check.dry_run:
        overrides += ["data.prompts_per_step=8", "data.eval_prompts=8", "train.micro_batch_size=8"]
    return overrides


def step_problems(check: Check, metrics: list[dict]) -> list[str]:
    """What is wrong in a run's logged steps: a non-finite loss or gradient norm, no weights pushed, or the
    rollout's logprobs off the trainer's (bf16 on both sides: the engine tests' mean bound; fp32 in the dry
    run: DESIGN's 1e-4)."""
    bound = 1e-4 if check.dry_run else 0.1
    problems = []
    for m in metrics:
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            problems.append(f"step {m['step']}: loss {m['loss']}, grad_norm {m['grad_norm']}")
        if m.get("handoff/bytes", 0) <= 0:
            problems.append(f"step {m['step']}: no weights pushed")
        if m["rollout/logprob_diff_mean"] > bound:
            problems.append(f"step {m['step']}: rollout/logprob_diff_mean {m['rollout/logprob_diff_mean']:.3g} "
                            f"> {bound}")
    return problems


def grpo_quickstart(check: Check) -> None:
    stage = "grpo_quickstart"
    run_dir = check.work / "quickstart_run"
    overrides = tiny_run(check, stage, run_dir)
    if overrides is None:
        return
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "megarl", "train",
                "recipes/quickstart.yaml", *overrides, "warmup.sft_steps=" + ("10" if check.dry_run else "30")]
    # The first run saves a resumable checkpoint at its end; the second one resumes from it for one step.
    saved_step, last_step = 2, 3
    proc = check.python(stage, [*torchrun, f"train.steps={saved_step}"])
    if failed(check, stage, proc, f"torchrun ... train.steps={saved_step}"):
        return
    latest = run_dir / "checkpoints" / "latest"
    saved = latest.read_text().strip() if latest.is_file() else None
    proc = check.python(stage, [*torchrun, f"train.steps={last_step}"])
    if failed(check, stage, proc, f"torchrun ... train.steps={last_step}"):
        return
    metrics = read_metrics(run_dir)
    steps = [m["step"] for m in metrics]
    problems = []
    if saved != f"step{saved_step:08d}":
        problems.append(f"the first run's latest checkpoint is {saved}, not step {saved_step}")
    # megarl.loops.resume logs "resuming from DIR (step S of N)"; the steps go on from there
    if f"(step {saved_step} of {last_step})" not in (check.out / f"{stage}.log").read_text():
        problems.append(f"the second run did not say it resumed from step {saved_step}")
    if steps != list(range(1, last_step + 1)):
        problems.append(f"steps {steps}, expected 1..{saved_step}, then {saved_step + 1}..{last_step} resumed")
    problems += step_problems(check, metrics)
    for m in metrics:
        for phase in ("sleep_trainer", "push", "wake_trainer"):  # offload, push on the device, onload
            if f"timing/{phase}_s" not in m:
                problems.append(f"step {m['step']}: no {phase} phase")
    if not (run_dir / "checkpoints" / "final" / "model.safetensors").is_file():
        problems.append("no final HF export")
    last = metrics[-1] if metrics else {}
    check.stages[stage] = dict(
        status="failed" if problems else "ok", detail="; ".join(problems[:3]) or
        f"{len(metrics)} steps, resumed after step {saved_step}; max logprob diff "
        f"{max(m['rollout/logprob_diff_max'] for m in metrics):.3g}",
        steps=len(metrics), resumed_after=saved_step,
        push_s=last.get("timing/push_s"), sleep_trainer_s=last.get("timing/sleep_trainer_s"),
        wake_trainer_s=last.get("timing/wake_trainer_s"),
        logprob_diff_max=max((m["rollout/logprob_diff_max"] for m in metrics), default=None))


# ---- 4 ---------------------------------------------------------------------------------------------------
def two_ranks(check: Check) -> None:
    stage = "two_ranks"
    run_dir = check.work / "two_ranks_run"
    overrides = tiny_run(check, stage, run_dir)
    if overrides is None:
        return
    steps = 2
    # Data parallel (dp = 2) with one engine for both ranks (rollout.tp = 2): the warm start's and RL's
    # gradients are all-reduced, samples, counts and sums cross the ranks. Every sample trains, so each step
    # reduces gradients; the plain optimizer, since gloo, standing in for NCCL, has no CUDA reduce-scatter.
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tools/device_check/two_ranks.py",
            "train", "recipes/quickstart.yaml", *overrides, "warmup.sft_steps=5", f"train.steps={steps}",
            "rollout.tp=2", "optim.distributed=false", "train.skip_zero_advantage=false",
            "checkpoint.save_final=false"]
    if failed(check, stage, check.python(stage, args), "torchrun --nproc_per_node=2 ... two_ranks.py"):
        return
    metrics = read_metrics(run_dir)
    problems = []
    log = (check.out / f"{stage}.log").read_text()
    device = "cpu" if check.dry_run else "cuda:0"
    for rank in (0, 1):
        if f"two_ranks: rank {rank} of 2, local rank {rank}, backend " not in log:
            problems.append(f"rank {rank} of 2 did not start")
    if log.count(f", device {device}\n") != 2:
        problems.append(f"not both ranks on {device}")
    if [m["step"] for m in metrics] != list(range(1, steps + 1)):
        problems.append(f"steps {[m['step'] for m in metrics]}, expected 1..{steps}")
    problems += step_problems(check, metrics)
    for m in metrics:
        if m.get("rollout/engines") != 1 or m.get("train/trained_frac") != 1:
            problems.append(f"step {m['step']}: {m.get('rollout/engines')} engines, trained "
                            f"{m.get('train/trained_frac')} of the samples, expected 1 and 1")
    check.stages[stage] = dict(
        status="failed" if problems else "ok", detail="; ".join(problems[:3]) or
        f"{len(metrics)} steps on 2 ranks ({device}), one engine; max logprob diff "
        f"{max(m['rollout/logprob_diff_max'] for m in metrics):.3g}",
        steps=len(metrics), logprob_diff_max=max((m["rollout/logprob_diff_max"] for m in metrics), default=None))


# ---- 5 ---------------------------------------------------------------------------------------------------
def bench_train(check: Check) -> None:
    stage = "bench_train"
    size, batch, seq, mbs = ("tiny", 4, 32, 2) if check.dry_run else ("1b", 16, 2048, 4)
    result = check.work / "bench_train.json"
    args = ["tools/bench_train.py", "--size", size, "--batch", str(batch), "--seq-len", str(seq),
            "--micro-batch-size", str(mbs), "--work-dir", str(check.work / "bench"), "--json", str(result)]
    args += ["--reps", "1", "--warmup", "0"] if check.dry_run else ["--reps", "3", "--warmup", "1",
                                                                    "--peak-tflops", str(H200_BF16_TFLOPS)]
    if failed(check, stage, check.python(stage, args), "bench_train.py"):
        return
    r = json.loads(result.read_text())
    # `megarl plan` for the same layout: one GPU, the same model, micro-batch and sequence length, the
    # benchmark's optimizer (Adam, not distributed); the policy model's bytes, without the plan's reserve.
    plan_json = check.work / "plan.json"
    plan = check.python(stage, ["-m", "megarl", "plan", "recipes/sft_tiny.yaml", f"model.path={r['model_dir']}",
                                f"model.dtype={r['dtype']}", f"train.micro_batch_size={mbs}",
                                "optim.distributed=false", "--nodes", "1", "--gpus-per-node", "1",
                                "--gpu-mem-gb", "141", "--seq-tokens", str(seq), "--json"],
                        stdout=plan_json)
    if failed(check, stage, plan, "megarl plan"):
        return
    estimate = json.loads(plan_json.read_text())["models"][0]  # the policy model, the only one of SFT
    r["plan_bytes"] = estimate["state"] + estimate["activations"]
    detail = f"{r['params'] / 1e9:.2f}B params, {r['megatron_tokens_per_s']:.0f} tok/s"
    if "mfu" in r:
        detail += f", {r['step_tflops']:.0f} TFLOP/s = {r['mfu']:.1%} MFU of {r['peak_tflops']:.0f}"
    if "peak_allocated_bytes" in r:
        r["peak_over_plan"] = r["peak_allocated_bytes"] / r["plan_bytes"]
        detail += (f"; peak {r['peak_allocated_bytes'] / 2**30:.2f} GiB vs plan {r['plan_bytes'] / 2**30:.2f} GiB "
                   f"({r['peak_over_plan']:.2f}x)")
    check.stages[stage] = dict(status="ok", detail=detail, **r)


# ---- 6 ---------------------------------------------------------------------------------------------------
def bench_handoff(check: Check) -> None:
    stage = "bench_handoff"
    result = check.work / "bench_handoff.json"
    args = ["tools/bench_handoff.py", "--engine", "native", "--workdir", str(check.work), "--json", str(result)]
    args += (["--device", "cpu", "--dtype", "float32", "--layers", "2", "--vocab-size", "4096", "--repeats", "1"]
             if check.dry_run else ["--device", "cuda", "--dtype", "bfloat16", "--bucket-mb", "64"])
    if failed(check, stage, check.python(stage, args), "bench_handoff.py"):
        return
    r = json.loads(result.read_text())
    detail = (f"push {r['push_gb_per_s']:.1f} GB/s vs copy {r['copy_gb_per_s']:.1f} GB/s "
              f"({r['push_over_copy']:.2f}x); peak extra {r['peak_extra_bytes'] / 2**20:.0f} MiB")
    check.stages[stage] = dict(status="ok", detail=detail, **r)


STAGES = (preflight, engine_tests, grpo_quickstart, two_ranks, bench_train, bench_handoff)


def table(check: Check) -> str:
    rows = [f"{'stage':16s} {'status':8s} detail"]
    for stage in STAGES:
        r = check.stages.get(stage.__name__, dict(status="not run", detail=""))
        detail = r.get("detail") or ", ".join(f"{k} {v}" for k, v in r.items() if k != "status")
        rows.append(f"{stage.__name__:16s} {r['status']:8s} {detail}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON, the table and the logs go")
    parser.add_argument("--dry-run", action="store_true", help="the same stages on the CPU with tiny shapes")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="megarl_device_check_"))
    check = Check(args.out, work, dry_run=args.dry_run)
    start = time.monotonic()
    try:
        for stage in STAGES:
            t0 = time.monotonic()
            if t0 >= check.deadline:
                check.stages[stage.__name__] = dict(status="timeout", detail=f"no time left of {TOTAL_S} s")
            else:
                check.begin(stage.__name__)
                stage(check)
            check.stages[stage.__name__]["seconds"] = round(time.monotonic() - t0, 1)
            # after every stage, so a check stopped from outside still returns what it found
            report = dict(dry_run=args.dry_run, seconds=round(time.monotonic() - start, 1), stages=check.stages)
            (args.out / "device_check.json").write_text(json.dumps(report, indent=2, default=str))
            if stage is preflight and check.stages["preflight"]["status"] != "ok":
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(check)
    (args.out / "device_check.txt").write_text(text + "\n")
    print(text)
    return 0 if all(r["status"] == "ok" for r in check.stages.values()) and len(check.stages) == len(STAGES) else 1


if __name__ == "__main__":
    sys.exit(main())
