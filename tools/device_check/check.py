"""The GPU check of megarl's own stack (native rollout engine, Megatron's local layer spec), in at most 8
minutes on one GPU, run by tools/device_check/run.sh after it installed the carried wheels:

1. preflight: versions, the device, its free memory;
2. engine tests on CUDA (tests/test_engine.py): logits and logprobs equal transformers' in fp32 (1e-4) for
   every architecture, bf16 parity (tolerances in the test: Megatron's error against fp32 at most twice
   transformers' own bf16 error, and within 0.1 mean / 0.6 max nats of transformers in bf16), the HF round
   trip, the weight push, micro-batch invariance, trainer offload and onload (memory drops, the same bytes
   come back); MoE routing replay (tests/test_router_replay.py: forced routes equal transformers', the native
   engine's routes give its logprobs, recording, recompute); no test may be skipped;
3. a bf16 GRPO quickstart under `torchrun --nproc_per_node=1` with the native engine: every step offloads
   the trainer, pushes the weights on the device and onloads it again; the run saves a checkpoint and a
   second run resumes from it for two more steps;
4. tools/bench_train.py at a 1B shape: MFU against the H200's 790 TFLOP/s bf16, and the peak memory of a
   step against `megarl plan`'s estimate for the same layout (parameters, gradients, optimizer state and
   activations of the policy model);
5. tools/bench_handoff.py on CUDA: the weight push against a device-to-device copy of the same tensors.

    python tools/device_check/check.py --out DIR [--dry-run]

--dry-run runs the same stages on the CPU with tiny shapes (fp32, fewer steps), so the wiring is proven
without a GPU; nothing in it is a measurement. Writes DIR/device_check.json and DIR/device_check.txt (the
table it prints) and each stage's output as DIR/<stage>.log. Exits 1 when a stage failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOTAL_S = 480  # the whole check, every stage included
H200_BF16_TFLOPS = 790.0  # dense bf16 matrix products measured on the lent H200 (8192^3, random data)


class Check:
    """The stages' shared state: where output goes, the deadline, and the results so far."""

    def __init__(self, out: Path, *, dry_run: bool):
        self.out, self.dry_run = out, dry_run
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + TOTAL_S
        self.stages: dict[str, dict] = {}

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1", MEGARL_CACHE=str(self.work / "cache"))
        return env

    def run(self, stage: str, argv: list[str], *, budget_s: float,
            stdout: Path | None = None) -> subprocess.CompletedProcess | None:
        """`argv` with its output in OUT/<stage>.log (its stdout in `stdout` if given), bounded by `budget_s`
        and by what is left of the whole check; None (and the stage marked as timed out) when it ran past."""
        timeout = max(1.0, min(budget_s, self.deadline - time.monotonic()))
        log = self.out / f"{stage}.log"
        with log.open("a") as f, (stdout.open("w") if stdout else f) as out:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            try:
                return subprocess.run(argv, cwd=REPO, env=self.env(), stdout=out, stderr=f, text=True,
                                      timeout=timeout)
            except subprocess.TimeoutExpired:
                f.write(f"\n[ran past {timeout:.0f} s]\n")
                self.stages[stage] = dict(status="timeout", detail=f"ran past {timeout:.0f} s")
                return None

    def python(self, stage: str, args: list[str], *, budget_s: float,
               stdout: Path | None = None) -> subprocess.CompletedProcess | None:
        return self.run(stage, [sys.executable, *args], budget_s=budget_s, stdout=stdout)


def failed(check: Check, stage: str, proc: subprocess.CompletedProcess | None, what: str) -> bool:
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
                "replays_given or engines_routes or r2_records or recomputed")
ENGINE_TESTS_DRY = "gpu_ or (equal_transformers and qwen2 and not moe)"


def engine_tests(check: Check) -> None:
    junit = check.out / "engine_tests.xml"
    args = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--basetemp={check.work / 'pytest'}",
            f"--junitxml={junit}", "tests/test_engine.py", "tests/test_router_replay.py",
            "-k", ENGINE_TESTS_DRY if check.dry_run else ENGINE_TESTS]
    proc = check.python("engine_tests", args, budget_s=150)
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


def grpo_quickstart(check: Check) -> None:
    stage = "grpo_quickstart"
    model, data, run_dir = check.work / "qs_model", check.work / "qs_data", check.work / "qs_run"
    made = check.python(stage, ["tools/make_tiny_model.py", "--out", str(model), "--hidden", "128", "--layers", "2",
                                "--heads", "8", "--kv-heads", "4", "--ffn", "256"], budget_s=60)
    if failed(check, stage, made, "make_tiny_model"):
        return
    made = check.python(stage, ["-m", "megarl.data.arithmetic", "--out", str(data)], budget_s=60)
    if failed(check, stage, made, "megarl.data.arithmetic"):
        return
    dtype = "float32" if check.dry_run else "bfloat16"
    common = [f"run_dir={run_dir}", f"model.path={model}", f"model.dtype={dtype}",
              f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'heldout.jsonl'}",
              "warmup.sft_steps=" + ("10" if check.dry_run else "100"), "rollout.engine=native", "log.progress=false"]
    if check.dry_run:
        common += ["data.prompts_per_step=8", "data.eval_prompts=8", "train.micro_batch_size=8"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "megarl", "train",
                "recipes/quickstart.yaml", *common]
    first_steps, resumed_steps = (2, 3) if check.dry_run else (4, 6)
    # The first run saves a resumable checkpoint at its end; the second one resumes from it and goes on.
    for steps in (first_steps, resumed_steps):
        proc = check.python(stage, [*torchrun, f"train.steps={steps}"], budget_s=150)
        if failed(check, stage, proc, f"torchrun ... train.steps={steps}"):
            return
    metrics = read_metrics(run_dir)
    problems = []
    if [m["step"] for m in metrics] != list(range(1, resumed_steps + 1)):
        problems.append(f"steps {[m['step'] for m in metrics]}, expected 1..{resumed_steps} with one resume")
    for m in metrics:
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            problems.append(f"step {m['step']}: loss {m['loss']}, grad_norm {m['grad_norm']}")
        if m.get("handoff/bytes", 0) <= 0:
            problems.append(f"step {m['step']}: no weights pushed")
        # bf16 on both sides (the engine tests' mean bound); fp32 in the dry run: DESIGN's 1e-4
        bound = 1e-4 if check.dry_run else 0.1
        diff = m["rollout/logprob_diff_mean"]
        if diff > bound:
            problems.append(f"step {m['step']}: rollout/logprob_diff_mean {diff:.3g} > {bound}")
        for phase in ("sleep_trainer", "push", "wake_trainer"):  # offload, push on the device, onload
            if f"timing/{phase}_s" not in m:
                problems.append(f"step {m['step']}: no {phase} phase")
    if not (run_dir / "checkpoints" / "final" / "model.safetensors").is_file():
        problems.append("no final HF export")
    last = metrics[-1] if metrics else {}
    check.stages[stage] = dict(
        status="failed" if problems else "ok", detail="; ".join(problems[:3]) or
        f"{len(metrics)} steps, resumed after step {first_steps}; max logprob diff "
        f"{max(m['rollout/logprob_diff_max'] for m in metrics):.3g}",
        dtype=dtype, steps=len(metrics), resumed_after=first_steps,
        push_s=last.get("timing/push_s"), sleep_trainer_s=last.get("timing/sleep_trainer_s"),
        wake_trainer_s=last.get("timing/wake_trainer_s"),
        logprob_diff_max=max((m["rollout/logprob_diff_max"] for m in metrics), default=None))


# ---- 4 ---------------------------------------------------------------------------------------------------
def bench_train(check: Check) -> None:
    stage = "bench_train"
    size, batch, seq, mbs = ("tiny", 4, 32, 2) if check.dry_run else ("1b", 16, 2048, 4)
    result = check.work / "bench_train.json"
    args = ["tools/bench_train.py", "--size", size, "--batch", str(batch), "--seq-len", str(seq),
            "--micro-batch-size", str(mbs), "--work-dir", str(check.work / "bench"), "--json", str(result)]
    args += ["--reps", "1", "--warmup", "0"] if check.dry_run else ["--reps", "3", "--warmup", "1",
                                                                    "--peak-tflops", str(H200_BF16_TFLOPS)]
    if failed(check, stage, check.python(stage, args, budget_s=200), "bench_train.py"):
        return
    r = json.loads(result.read_text())
    # `megarl plan` for the same layout: one GPU, the same model, micro-batch and sequence length, the
    # benchmark's optimizer (Adam, not distributed); the policy model's bytes, without the plan's reserve.
    plan_json = check.work / "plan.json"
    plan = check.python(stage, ["-m", "megarl", "plan", "recipes/sft_tiny.yaml", f"model.path={r['model_dir']}",
                                f"model.dtype={r['dtype']}", f"train.micro_batch_size={mbs}",
                                "optim.distributed=false", "--nodes", "1", "--gpus-per-node", "1",
                                "--gpu-mem-gb", "141", "--seq-tokens", str(seq), "--json"],
                        budget_s=60, stdout=plan_json)
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


# ---- 5 ---------------------------------------------------------------------------------------------------
def bench_handoff(check: Check) -> None:
    stage = "bench_handoff"
    result = check.work / "bench_handoff.json"
    args = ["tools/bench_handoff.py", "--engine", "native", "--workdir", str(check.work), "--json", str(result)]
    args += (["--device", "cpu", "--dtype", "float32", "--layers", "2", "--vocab-size", "4096", "--repeats", "1"]
             if check.dry_run else ["--device", "cuda", "--dtype", "bfloat16", "--bucket-mb", "64"])
    if failed(check, stage, check.python(stage, args, budget_s=120), "bench_handoff.py"):
        return
    r = json.loads(result.read_text())
    detail = (f"push {r['push_gb_per_s']:.1f} GB/s vs copy {r['copy_gb_per_s']:.1f} GB/s "
              f"({r['push_over_copy']:.2f}x); peak extra {r['peak_extra_bytes'] / 2**20:.0f} MiB")
    check.stages[stage] = dict(status="ok", detail=detail, **r)


STAGES = (preflight, engine_tests, grpo_quickstart, bench_train, bench_handoff)


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
    check = Check(args.out, dry_run=args.dry_run)
    start = time.monotonic()
    for stage in STAGES:
        t0 = time.monotonic()
        if time.monotonic() >= check.deadline:
            check.stages[stage.__name__] = dict(status="timeout", detail=f"no time left of {TOTAL_S} s")
        else:
            stage(check)
        check.stages[stage.__name__]["seconds"] = round(time.monotonic() - t0, 1)
        if stage is preflight and check.stages["preflight"]["status"] != "ok":
            break
    report = dict(dry_run=args.dry_run, seconds=round(time.monotonic() - start, 1), stages=check.stages)
    (args.out / "device_check.json").write_text(json.dumps(report, indent=2, default=str))
    text = table(check)
    (args.out / "device_check.txt").write_text(text + "\n")
    print(text)
    return 0 if all(r["status"] == "ok" for r in check.stages.values()) and len(check.stages) == len(STAGES) else 1


if __name__ == "__main__":
    sys.exit(main())
