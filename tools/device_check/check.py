"""The device probe: what one lent GPU (no SGLang, no Transformer Engine, no network) can prove of megarl's GPU
path in at most TOTAL_S seconds, run by tools/device_check/run.sh after it installed the carried wheels. Each
stage runs in its own processes within its own budget (BUDGET_S); one that runs past it is ended and reported,
and the stages after it still run.

0. preflight: versions (torch, CUDA, transformers, megatron-core, torch_memory_saver), the device, its memory;
1. world (probes.py world, under torchrun): megarl's `init_parallel` world and every Megatron group carry gloo
   for host tensors and NCCL for device tensors; sums of both, object collectives and barriers work on each;
   NCCL alone refuses a host tensor in the words of the CPU tests' emulation (tests/gpu_world_worker.py);
2. memory_saver (probes.py memory_saver): torch_memory_saver 0.0.10, as SGLang hooks it (LD_PRELOAD; its
   pluggable allocator when that cannot load), pauses a "weights" region, the trainer writes the freed memory,
   the region resumes: without a CPU backup its contents are lost, with one they are kept (finding N1);
3. pinned (probes.py pinned): page-locked bytes for one PARK_BYTES park, as torch's caching host allocator
   rounds them (megarl's offload today) and as cudaHostRegister takes them, the time to pin, D2H and H2D
   GB/s; TrainerMemory's `offloaded_bytes` and `host_bytes` for the engine offload test's model (N4);
4. engine_tests: pytest on tests/test_engine.py's `test_gpu_*` (bf16 parity with transformers, fused against
   unfused kernels, trainer offload and onload) and tests/test_handover.py's offload tests, on CUDA;
5. grpo_quickstart: `megarl train recipes/quickstart.yaml` in bf16 under torchrun (native engine, no warm
   start), 2 steps with a checkpoint after each, `checkpoint.save_final` and the HF export, which transformers
   must load.

    python tools/device_check/check.py --out DIR [--dry-run] [--only STAGE,...]

--dry-run runs every stage on the CPU with tiny shapes: gloo for the world (two ranks), a stand-in of
torch_memory_saver with the same calls, a park that says it pins nothing without CUDA, the tests as CPU
pytest runs them (the GPU-only ones skip), the run in fp32; nothing in it is a measurement. --only reruns the
named stages (the preflight always runs). DIR receives device_check.json (figures and statuses, rewritten after
every stage), device_check.md (the table it prints) and one log per stage, and nothing else: the machine
returns at most 8 files. Models, runs and caches go to a scratch folder, removed at the end. Exits 1 when a
stage failed or ran past its budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBES = Path(__file__).resolve().parent / "probes.py"
WHEELS = REPO / ".device_wheels"
# The whole check; run.sh installs the wheels before it, within the machine's 600 s per command.
TOTAL_S = 480
# Each stage's time, all its processes together. Their sum stays under TOTAL_S, so a stage that runs to its
# budget takes no time from the stages after it; what is left covers the check's own bookkeeping.
BUDGET_S = dict(preflight=15, world=40, memory_saver=35, pinned=60, engine_tests=160, grpo_quickstart=150)
# One park of the 70B GRPO recipe (TP 8, PP 2, DP 4): the bf16 parameter buffer of one GPU (finding N4).
PARK_BYTES = 8_800_000_000
REGION_BYTES = 2**30  # each torch_memory_saver region: SGLang's weights, scaled down
DRY_RUN_BYTES = 64 * 2**20  # both, in the dry run
# The engine's bf16 tests on CUDA and the hand-over's offload tests (CUDA storage, pinned host buffers).
ENGINE_TESTS = ["tests/test_engine.py", "tests/test_handover.py",
                "tests/test_optimizer_offload.py::test_gpu_offloaded_optimizer_trains_as_the_resident_one",
                "-k", "test_gpu_ or offload"]


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
                   PYTHONUNBUFFERED="1", MEGARL_CACHE=str(self.work / "cache"),
                   # launch/torchrun.sh's setting: Megatron's overlap of communication and compute needs it
                   CUDA_DEVICE_MAX_CONNECTIONS="1")
        return env

    def run(self, stage: str, argv: list[str]) -> subprocess.Popen | None:
        """`argv` with its output appended to OUT/<stage>.log, bounded by what is left of the stage's budget;
        None (and the stage marked as timed out) when it ran past."""
        timeout = max(1.0, self.stage_deadline - time.monotonic())
        with (self.out / f"{stage}.log").open("a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            # In its own process group, ended whole when it returns or runs past: a worker that torchrun
            # left behind would hold the GPU through the stages after it.
            proc = subprocess.Popen(argv, cwd=REPO, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
                return proc
            except subprocess.TimeoutExpired:
                log.write(f"\n[ran past {timeout:.0f} s]\n")
                self.stages[stage] = dict(status="timeout", detail=f"ran past its {BUDGET_S.get(stage)} s")
                return None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def python(self, stage: str, args: list[str]) -> subprocess.Popen | None:
        return self.run(stage, [sys.executable, *args])

    def probe(self, stage: str, args: list[str], *, nproc: int | None = None) -> tuple[subprocess.Popen | None, dict]:
        """probes.py ARGS (under torchrun with `nproc` ranks when given) and the figures it wrote ({} if none)."""
        figures_path = self.work / f"{stage}-{len(list(self.work.glob(f'{stage}-*.json')))}.json"
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
        proc = self.python(stage, [*launcher, str(PROBES), args[0], "--json", str(figures_path), *args[1:]])
        figures = json.loads(figures_path.read_text()) if figures_path.is_file() else {}
        return proc, figures

    def done(self, stage: str, proc: subprocess.Popen | None, figures: dict, detail: str, *,
             problems: list[str] = ()) -> None:
        """Record a stage from its last process and figures: ok when that process exited 0 and nothing is wrong."""
        if proc is None:  # ran past its budget: what it wrote so far still counts
            self.stages[stage].update(figures=figures)
            return
        problems = [*figures.get("problems", []), *problems]
        if proc.returncode != 0 and not problems:
            tail = (self.out / f"{stage}.log").read_text().strip().splitlines()[-1:] or [""]
            problems = [f"exited {proc.returncode}: {tail[0][:200]}"]
        self.stages[stage] = dict(status="failed" if problems else "ok",
                                  detail="; ".join(problems[:3]) if problems else detail, figures=figures)


def gib(nbytes: float | None) -> str:
    if nbytes is None:
        return "?"
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def seconds(s: float | None) -> str:
    return "?" if s is None else f"{s:.3f} s"


# ---- 0 ---------------------------------------------------------------------------------------------------
def preflight(check: Check) -> None:
    import importlib.metadata as md

    import torch

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                **{dist: version(dist) for dist in ("transformers", "megatron-core", "torch_memory_saver", "megarl")})
    detail = ", ".join(f"{k} {v}" for k, v in info.items())
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info |= dict(device=torch.cuda.get_device_name(), free_bytes=free, total_bytes=total)
        detail += f"; {info['device']}, {gib(free)} of {gib(total)} free"
    elif not check.dry_run:
        check.stages["preflight"] = dict(status="failed", detail="no CUDA device visible to torch", figures=info)
        return
    else:
        info["device"] = "cpu (dry run)"
        detail += "; cpu (dry run)"
    check.stages["preflight"] = dict(status="ok", detail=detail, figures=info)


# ---- 1 ---------------------------------------------------------------------------------------------------
def world(check: Check) -> None:
    # NCCL refuses two ranks on one device, so one rank on the GPU; two on the CPU, where gloo has peers.
    proc, r = check.probe("world", ["world"], nproc=2 if check.dry_run else 1)
    groups = r.get("groups", {})
    routes = sorted({f"host tensors to {g.get('cpu_backend')}, device tensors to "
                     f"{g.get('cuda_backend', 'none (no CUDA)')}" for g in groups.values()})
    detail = (f"{r.get('world_size')} rank(s), {r.get('backend')}"
              + (f", NCCL {r['nccl_version']}" if "nccl_version" in r else "")
              + f"; {len(groups)} groups ({', '.join(groups)}): {'; '.join(routes)}; "
              "host and device sums, object collectives and barriers right on each; a group of "
              + ("NCCL" if "refusal_nccl" in r else "gloo on CUDA only")
              + f" refuses host tensors: {r.get('refusal_nccl', r.get('refusal_emulated'))!r}")
    check.done("world", proc, r, detail)


# ---- 2 ---------------------------------------------------------------------------------------------------
def memory_saver(check: Check) -> None:
    nbytes = DRY_RUN_BYTES if check.dry_run else REGION_BYTES
    args = ["memory_saver", "--bytes", str(nbytes)]
    if check.dry_run:
        proc, r = check.probe("memory_saver", [*args, "--wheels", str(WHEELS)])
    else:
        # SGLang's hook first; torch_memory_saver's pluggable allocator (the same pause and resume) when the
        # preload library cannot load on this machine. Each try is in the figures.
        tries = []
        for mode in ("preload", "torch"):
            proc, r = check.probe("memory_saver", [*args, "--mode", mode])
            tries.append(dict(mode=mode, exit=None if proc is None else proc.returncode, problems=r.get("problems")))
            if proc is None or proc.returncode == 0:
                break
        r["tries"] = tries
    regions = r.get("regions", {})
    parts = [f"the {t['mode']} hook failed (exit {t['exit']}: {t['problems'] or 'see the log'})"
             for t in r.get("tries", [])[:-1]]
    for m in regions.values():
        part = (f"{'with' if m['cpu_backup'] else 'without'} CPU backup {m['kept_fraction']:.1%} of the words kept "
                f"({m['zero_fraction']:.1%} zero, {m['scribble_fraction']:.1%} the trainer's), pause "
                f"{seconds(m['pause_s'])}, resume {seconds(m['resume_s'])}")
        if "freed_on_pause_bytes" in m:
            part += f", {gib(m['freed_on_pause_bytes'])} freed of {gib(m['bytes'])}"
        parts.append(part)
    api = r.get("wheel_api", {})
    if api:
        parts.append(f"carried wheel's API {'read' if api.get('checked') else 'not read: ' + str(api.get('why'))}")
    detail = f"{r.get('saver')}{' (' + r['hook_mode'] + ' hook)' if 'hook_mode' in r else ''}: " + "; ".join(parts)
    check.done("memory_saver", proc, r, detail)


# ---- 3 ---------------------------------------------------------------------------------------------------
def pinned(check: Check) -> None:
    nbytes = DRY_RUN_BYTES if check.dry_run else PARK_BYTES
    proc, r = check.probe("pinned", ["pinned", "--bytes", str(nbytes), "--work", str(check.work)])
    park, trainer = r.get("park", {}), r.get("trainer", {})
    if "no_cuda" in park:
        detail = f"{gib(nbytes)} park: no CUDA, nothing page-locked"
    else:
        t, g = park.get("torch_pin_memory", {}), park.get("cuda_host_register", {})
        locked = t.get("pinned_bytes", t.get("host_left_bytes"))
        detail = (f"{nbytes / 1e9:.1f} GB park: pin_memory page-locks {gib(locked)} "
                  f"({(locked or 0) / nbytes:.2f}x) in {seconds(t.get('alloc_s'))}, D2H {t.get('d2h_gb_s')} / H2D "
                  f"{t.get('h2d_gb_s')} GB/s; cudaHostRegister {gib(g.get('host_left_bytes'))} in "
                  f"{seconds(g.get('register_s'))}, D2H {g.get('d2h_gb_s')} / H2D {g.get('h2d_gb_s')} GB/s")
    if trainer:
        detail += (f"; trainer ({trainer['model']}): offloaded_bytes {trainer['offloaded_bytes']}, host_bytes "
                   f"{trainer['host_bytes']}, pinned by torch {trainer.get('pinned_bytes', 'n/a (no CUDA)')}")
    check.done("pinned", proc, r, detail)


# ---- 4 ---------------------------------------------------------------------------------------------------
OUTCOME = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", re.M)


def test_outcomes(log: str) -> tuple[dict[str, str], int | None, str | None]:
    """From pytest -v's output (complete or cut off): each finished test's outcome (an error after a pass,
    in teardown, counts), the number pytest selected, and the test it was running when the output ends."""
    outcomes: dict[str, str] = {}
    for test, outcome in OUTCOME.findall(log):
        if outcomes.get(test) in (None, "PASSED", "SKIPPED"):
            outcomes[test] = outcome
    selected = re.search(r"collected (\d+) items?(?: / (\d+) deselected)?(?: / (\d+) selected)?", log)
    n = None
    if selected:
        n = int(selected[3]) if selected[3] else int(selected[1]) - int(selected[2] or 0)
    started = re.findall(r"^(\S+::\S+)", log, re.M)
    running = started[-1] if started and started[-1] not in outcomes else None
    return outcomes, n, running


def engine_tests(check: Check) -> None:
    stage = "engine_tests"
    args = ["-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-o", "console_output_style=classic",
            f"--basetemp={check.work / 'pytest'}", *ENGINE_TESTS]
    proc = check.python(stage, args)
    outcomes, selected, running = test_outcomes((check.out / f"{stage}.log").read_text())
    by = {k: sorted(t.split("::")[-1] for t, o in outcomes.items() if o == k) for k in set(outcomes.values())}
    figures = dict(selected=selected, outcomes=outcomes, running_when_stopped=running)
    not_started = (selected or 0) - len(outcomes) - (running is not None)
    parts = [f"{k.lower()}: {', '.join(v)}" for k, v in sorted(by.items())]
    if running:
        parts.append(f"running when stopped: {running.split('::')[-1]}")
    if not_started > 0:
        parts.append(f"not started: {not_started}")
    detail = f"{len(outcomes)} of {selected} ran; " + "; ".join(parts)
    if proc is None:
        check.stages[stage].update(detail=f"ran past its {BUDGET_S[stage]} s; {detail}", figures=figures)
        return
    problems = [f"{len(by[k])} {k.lower()}" for k in ("FAILED", "ERROR") if k in by]
    if not outcomes:
        problems.append("no test ran")
    if by.get("SKIPPED") and not check.dry_run:  # every test selected here runs on a GPU
        problems.append(f"skipped on a GPU: {', '.join(by['SKIPPED'])}")
    if problems:
        problems.append(detail)
    check.done(stage, proc, figures, detail, problems=problems)


# ---- 5 ---------------------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def step_problems(metrics: list[dict], *, steps: int, bound: float) -> list[str]:
    """What is wrong in a run's logged steps: not steps 1..`steps`, a non-finite loss or gradient norm, no
    weights pushed, no offload, push and onload phase, or the rollout's logprobs further than `bound` (mean
    over tokens) from the trainer's."""
    problems = []
    if [m.get("step") for m in metrics] != list(range(1, steps + 1)):
        problems.append(f"steps {[m.get('step') for m in metrics]}, expected 1..{steps}")
    for m in metrics:
        if not (math.isfinite(m.get("loss", math.nan)) and math.isfinite(m.get("grad_norm", math.nan))):
            problems.append(f"step {m['step']}: loss {m.get('loss')}, grad_norm {m.get('grad_norm')}")
        if m.get("handoff/bytes", 0) <= 0:
            problems.append(f"step {m['step']}: no weights pushed")
        if m.get("rollout/logprob_diff_mean", math.inf) > bound:
            problems.append(f"step {m['step']}: rollout/logprob_diff_mean {m.get('rollout/logprob_diff_mean')} "
                            f"> {bound}")
        for phase in ("sleep_trainer", "push", "wake_trainer"):  # offload, push on the device, onload
            if f"timing/{phase}_s" not in m:
                problems.append(f"step {m['step']}: no {phase} phase")
    return problems


def grpo_quickstart(check: Check) -> None:
    stage = "grpo_quickstart"
    model, data, run_dir = check.work / "tiny_model", check.work / "arithmetic", check.work / "quickstart_run"
    for what, args, made in (
            ("make_tiny_model", ["tools/make_tiny_model.py", "--out", str(model), "--hidden", "128", "--layers", "2",
                                 "--heads", "8", "--kv-heads", "4", "--ffn", "256"], model / "config.json"),
            ("megarl.data.arithmetic", ["-m", "megarl.data.arithmetic", "--out", str(data)], data / "train.jsonl")):
        proc = check.python(stage, args)
        if proc is None or proc.returncode != 0 or not made.is_file():
            check.done(stage, proc, {}, "", problems=[f"{what} did not make {made.name}"])
            return
    steps = 2
    overrides = [f"run_dir={run_dir}", f"model.path={model}",
                 "model.dtype=" + ("float32" if check.dry_run else "bfloat16"),
                 f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'heldout.jsonl'}",
                 "rollout.engine=native", "warmup.sft_steps=0", f"train.steps={steps}",
                 # a random model earns no reward: train on every sample, so each step updates and offloads
                 "train.skip_zero_advantage=false",
                 "checkpoint.every_steps=1", "checkpoint.save_final=true", "log.progress=false"]
    if check.dry_run:
        overrides += ["data.prompts_per_step=8", "data.eval_prompts=8", "train.micro_batch_size=8"]
    proc = check.python(stage, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "megarl",
                                "train", "recipes/quickstart.yaml", *overrides])
    if proc is None or proc.returncode != 0:
        check.done(stage, proc, {}, "")
        return
    metrics = read_metrics(run_dir)
    # bf16 on both sides: the engine tests' mean bound; fp32 in the dry run: DESIGN's 1e-4
    problems = step_problems(metrics, steps=steps, bound=1e-4 if check.dry_run else 0.1)
    checkpoints = run_dir / "checkpoints"
    saved = sorted(p.name for p in checkpoints.glob("step*"))
    latest = (checkpoints / "latest").read_text().strip() if (checkpoints / "latest").is_file() else None
    if saved != [f"step{n:08d}" for n in range(1, steps + 1)] or latest != f"step{steps:08d}":
        problems.append(f"checkpoints {saved}, latest {latest}: expected one after each of the {steps} steps")
    final = checkpoints / "final"
    export: dict = {}
    if not (final / "model.safetensors").is_file():
        problems.append("no HF export in checkpoints/final")
    else:
        proc, export = check.probe(stage, ["export", str(final)])
        if proc is None:
            check.done(stage, proc, dict(export=export), "")
            return
        if proc.returncode != 0:
            problems.append(f"transformers did not load checkpoints/final: {export.get('problems') or 'see the log'}")
    last = metrics[-1] if metrics else {}
    figures = dict(steps=len(metrics), checkpoints=saved, export=export,
                   **{k: last.get(k) for k in ("timing/sleep_trainer_s", "timing/push_s", "timing/wake_trainer_s",
                                               "handoff/bytes")},
                   logprob_diff_max=max((m.get("rollout/logprob_diff_max", math.nan) for m in metrics), default=None))
    detail = (f"{len(metrics)} steps, checkpoints {', '.join(saved)}, final export loads in transformers "
              f"({export.get('dtype')}, finite logits); last step: offload "
              f"{seconds(last.get('timing/sleep_trainer_s'))}, push {seconds(last.get('timing/push_s'))}, "
              f"onload {seconds(last.get('timing/wake_trainer_s'))}; max logprob diff {figures['logprob_diff_max']}")
    check.done(stage, proc, figures, detail, problems=problems)


STAGES = (preflight, world, memory_saver, pinned, engine_tests, grpo_quickstart)


def table(check: Check) -> str:
    """The stages as one Markdown table: status, seconds against the budget, what each found."""
    rows = ["| stage | status | seconds (budget) | what it found |", "| --- | --- | --- | --- |"]
    for n, stage in enumerate(STAGES):
        r = check.stages.get(stage.__name__, dict(status="not run", detail=""))
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {n}. {stage.__name__} | {r['status']} | {r.get('seconds', '')} ({BUDGET_S[stage.__name__]}) "
                    f"| {detail} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON, the table and the logs go")
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU with tiny shapes")
    parser.add_argument("--only", help="comma-separated stages to run (a rerun); the preflight always runs")
    args = parser.parse_args(argv)
    names = [stage.__name__ for stage in STAGES]
    only = set(args.only.split(",")) if args.only else set(names)
    if only - set(names):
        parser.error(f"unknown stages {sorted(only - set(names))}; the stages are {', '.join(names)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="megarl_device_check_"))
    check = Check(args.out, work, dry_run=args.dry_run)
    start = time.monotonic()
    try:
        for stage in STAGES:
            name = stage.__name__
            if name not in only and stage is not preflight:
                continue
            t0 = time.monotonic()
            if t0 >= check.deadline:
                check.stages[name] = dict(status="timeout", detail=f"no time left of {TOTAL_S} s")
            else:
                check.begin(name)
                stage(check)
            check.stages[name]["seconds"] = round(time.monotonic() - t0, 1)
            # after every stage, so a check stopped from outside still returns what it found
            report = dict(dry_run=args.dry_run, seconds=round(time.monotonic() - start, 1), total_budget_s=TOTAL_S,
                          stages=check.stages)
            (args.out / "device_check.json").write_text(json.dumps(report, indent=2, default=str))
            (args.out / "device_check.md").write_text(table(check) + "\n")
            if stage is preflight and check.stages[name]["status"] != "ok":
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(check))
    print(f"\n{time.monotonic() - start:.0f} s in all")
    ran = [check.stages.get(name, {}).get("status") for name in names if name in only or name == "preflight"]
    return 0 if all(status == "ok" for status in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
