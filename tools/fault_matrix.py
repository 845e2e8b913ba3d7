"""What a run survives: the quickstart-size GRPO run once without a fault and once per fault, each injected at
a chosen step and phase (the recipe's `faults`, megarl.inject), launched as a user launches it
(launch/torchrun.sh, 2 ranks, its restarts; a run that stops for a signal is launched again, as a SLURM requeue
would), and compared with the fault-free run.

    python tools/fault_matrix.py --out DIR [--quick] [--only NAME ...]

Prints one row per fault and writes DIR/fault_matrix.md and DIR/fault_matrix.json (one object per fault):

    outcome            recovered in place | resumed from step N (restarted by launch/torchrun.sh, or launched
                       again as a requeue) | stopped: the named error and the exit code
    detected_s         seconds from the fault to the first line that shows it was noticed (its `detect` pattern)
    prompts_lost       prompt rows the fault-free run trained and this run did not (RUN_DIR/prompts.jsonl)
    prompts_repeated   prompt rows this run trained more often than the fault-free run did
    samples_lost       the samples of the prompts lost (rollout.n_samples each)
    samples_failed     samples scored 0 and counted (reward/failures), more than the fault-free run's
    steps_recomputed   steps finished twice (once before the fault, again after a resume)
    exact              the final weights bit for bit and every logged number but timings equal the fault-free
                       run's; `differs` says what differs when not

Needs 2 CPU cores; the full matrix takes about 8 minutes, --quick about 3. A fault whose backend is not
installed here (the SGLang scheduler kill without SGLang) is listed with why it was not run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
STEPS = 5
N_SAMPLES = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())["rollout"]["n_samples"]
FAULT_STEP = 3
LAUNCH_TIMEOUT_S = 600
# The quickstart's recipe from a random model, small enough that a run is a minute on 2 cores: no warm start,
# the length penalty beside the exact answer (so the rewards of a group differ) and an entropy bonus (so every
# sample trains and the weights move at every step); a checkpoint every step, for the restarts.
BASE = [
    "warmup.sft_steps=0", f"train.steps={STEPS}", "data.prompts_per_step=8", "data.eval_path=null",
    "train.micro_batch_size=16", "algo.entropy_coef=0.01", "optim.lr=1.0e-2", "optim.warmup_steps=0",
    "reward.terms=[{kind: exact_answer}, {kind: length_penalty, max_tokens: 6, cache_tokens: 4}]",
    "checkpoint.every_steps=1", "checkpoint.keep_last=0", "parallel.timeout_minutes=0.5", "log.progress=true",
]
LAYOUTS = {
    "colocated": [],
    "split": ["placement.mode=split", "placement.rollout_ranks=1", "algo.max_staleness=1"],
    "sglang": ["rollout.engine=sglang"],
    "sglang-split": ["rollout.engine=sglang", "placement.mode=split", "placement.rollout_ranks=1", "algo.max_staleness=1"],
}
SGLANG_RESTARTS = ("SGLang's sampler state lives in its scheduler and cannot be set back: the new engine samples "
                   "its batch anew")


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    faults: list[dict]  # the recipe's `faults`
    detect: str  # a pattern of the first output line that shows the fault was noticed
    layout: str = "colocated"
    overrides: tuple[str, ...] = ()
    quick: bool = False
    corrupt_before_relaunch: bool = False  # the run is stopped, its newest checkpoint damaged, and launched again
    needs: str | None = None  # a module the fault's backend needs
    inexact: str | None = None  # why the recovery cannot be bit-exact, where it cannot


# torchrun's lines when a worker dies: it stops the others (SIGTERM) and names the one that failed; a peer in a
# gloo collective sees the connection reset first
RECOVERY_COUNTS = ("rollout/engine_restarts", "rollout/redispatched", "env/retries")  # a recovery's own counts
SCORED_ZERO = "the sample that failed scores 0, so step 3 trains on another reward"
DIED = r"Connection reset by peer|closing signal SIGTERM|failed \(exitcode"
FAULTS = [
    Fault("native engine dies mid-generate", "the engine's generate call fails halfway (a device error)",
          [{"kind": "engine_crash", "step": FAULT_STEP}], r"restarting \(restart", quick=True),
    Fault("SGLang scheduler killed mid-generate", "SIGKILL to the SGLang scheduler as a generate call starts",
          [{"kind": "engine_kill", "step": FAULT_STEP}], r"restarting \(restart", layout="sglang", needs="sglang",
          inexact=SGLANG_RESTARTS),
    Fault("SGLang scheduler killed mid-generate (split)", "placement split: SIGKILL to the rollout rank's SGLang "
          "scheduler as a generate call starts", [{"kind": "engine_kill", "step": FAULT_STEP, "rank": 1}],
          r"restarting its engine", layout="sglang-split", needs="sglang", inexact=SGLANG_RESTARTS),
    Fault("engine returns fewer samples", "a generate call returns without its last response, raising nothing",
          [{"kind": "engine_short", "step": FAULT_STEP}], r"returned \d+ responses for \d+ prompts"),
    Fault("rollout engine dies mid-generate (split)", "placement split: the rollout rank's engine fails halfway",
          [{"kind": "engine_crash", "step": FAULT_STEP, "rank": 1}], r"restarting its engine", layout="split"),
    Fault("rollout rank killed (split)", "placement split: SIGKILL to the rollout rank as it generates",
          [{"kind": "kill", "step": FAULT_STEP, "phase": "generate", "rank": 1}], DIED, layout="split", quick=True),
    Fault("trainer rank killed mid-step", "SIGKILL to rank 1 as it starts training",
          [{"kind": "kill", "step": FAULT_STEP, "phase": "train", "rank": 1}], DIED, quick=True),
    Fault("collective peer hangs", "rank 1 stops before training; rank 0 waits in a collective",
          [{"kind": "hang", "step": FAULT_STEP, "phase": "train", "rank": 1}], r"[Tt]imed? ?out|timeout"),
    Fault("NaN loss on one rank", "rank 1's advantages are NaN, so is its loss",
          [{"kind": "nan", "step": FAULT_STEP, "rank": 1}], r"non-finite|not finite|nan"),
    Fault("disk full while checkpointing", "the step's checkpoint write fails with ENOSPC",
          [{"kind": "disk_full", "step": FAULT_STEP}], r"disk|No space left"),
    Fault("checkpoint damaged at resume", "killed in step 4; a shard of the newest checkpoint is cut short "
          "before the run is launched again", [{"kind": "kill", "step": FAULT_STEP + 1, "phase": "train"}],
          r"is damaged", corrupt_before_relaunch=True, quick=True),
    Fault("SIGTERM during a push", "rank 0 gets SIGTERM as the step's weights go to the engines",
          [{"kind": "sigterm", "step": FAULT_STEP, "phase": "push", "rank": 0}], r"SIGTERM", quick=True),
    Fault("environment raises mid-episode", "the step's first environment step raises",
          [{"kind": "env_error", "step": FAULT_STEP}], r"environment step of trajectory \d+ raised"),
    Fault("reward worker killed", "the process scoring the step's first sample (a Ray worker) is SIGKILLed",
          [{"kind": "reward_kill", "step": FAULT_STEP, "rank": 0}], r"worker died",
          overrides=("reward.workers=1",), needs="ray"),
    Fault("reward worker hangs", "scoring the step's first sample on a Ray worker never returns",
          [{"kind": "reward_hang", "step": FAULT_STEP, "rank": 0}], r"failed|timed out|longer than",
          overrides=("reward.workers=1", "reward.timeout_s=5"), inexact=SCORED_ZERO),
    Fault("code sandbox program never exits", "scoring the step's first sample runs a program that never exits "
          "in the code sandbox", [{"kind": "sandbox_hang", "step": FAULT_STEP, "rank": 0}], r"never exits",
          inexact=SCORED_ZERO),
    Fault("reward hangs in the trainer", "scoring the step's first sample in the trainer never returns",
          [{"kind": "reward_hang", "step": FAULT_STEP, "rank": 0}], r"failed|timed out|longer than",
          overrides=("reward.timeout_s=5",), inexact=SCORED_ZERO),
]


@dataclass
class Launch:
    code: int
    lines: list[tuple[float, str]]  # (seconds since the launch started, line)
    seconds: float


@dataclass
class Row:
    fault: str
    what: str
    injected: list[dict]
    outcome: str = ""
    detected_s: float | None = None
    launches: int = 0
    exit_codes: list[int] = field(default_factory=list)
    prompts_lost: int = 0
    prompts_repeated: int = 0
    samples_lost: int = 0
    samples_failed: int = 0
    steps_recomputed: int = 0
    engine_restarts: int = 0
    env_retries: int = 0
    exact: bool = False
    differs: str = ""
    inexact_because: str | None = None  # the fault's reason, where a recovery cannot be bit-exact
    wall_s: float = 0.0


# ---- running -----------------------------------------------------------------------------------------------
def launch(run_dir: Path, overrides: list[str], *, python: str, max_restarts: int) -> Launch:
    """launch/torchrun.sh with 2 processes, its output timestamped line by line."""
    env = dict(os.environ, NPROC="2", MAX_RESTARTS=str(max_restarts), OMP_NUM_THREADS="1",
               PATH=f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}")
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(REPO / "recipes" / "quickstart.yaml"),
           f"run_dir={run_dir}", *overrides]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        lines.append((time.monotonic() - start, f"fault_matrix: killed after {LAUNCH_TIMEOUT_S} s"))
    reader.join(timeout=10)
    with open(run_dir.with_suffix(".log"), "a") as log:
        log.writelines(f"{t:9.3f} {line}\n" for t, line in lines)
    return Launch(code, lines, time.monotonic() - start)


def run(run_dir: Path, overrides: list[str], *, python: str, corrupt_before_relaunch: bool = False) -> list[Launch]:
    """A run to its end as a user's launcher takes it: launch/torchrun.sh starts a failed job again twice; a run
    that stopped for a signal (exit 143) is launched again once, as a requeue. `corrupt_before_relaunch`: the
    first launch gets no restart; the newest checkpoint it left is damaged before the second."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.with_suffix(".log").unlink(missing_ok=True)
    launches = [launch(run_dir, overrides, python=python, max_restarts=0 if corrupt_before_relaunch else 2)]
    if corrupt_before_relaunch and launches[-1].code != 0:
        damage_newest_checkpoint(run_dir)
        launches.append(launch(run_dir, overrides, python=python, max_restarts=2))
    elif launches[-1].code == 143:
        launches.append(launch(run_dir, overrides, python=python, max_restarts=2))
    return launches


def damage_newest_checkpoint(run_dir: Path) -> None:
    """Cut the largest file of the checkpoint `latest` names to half its size, as a full disk or a failed copy
    leaves it."""
    root = run_dir / "checkpoints"
    newest = root / (root / "latest").read_text().strip()
    largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)


# ---- reading a run -----------------------------------------------------------------------------------------
def records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    path = run_dir / "checkpoints" / "final" / "model.safetensors"
    return load_file(str(path)) if path.exists() else {}


def compare(run_dir: Path, clean_dir: Path) -> tuple[bool, str]:
    """Whether the run ends as the fault-free one did: weights bit for bit, every number but timings."""
    import torch

    ours, theirs = final_weights(run_dir), final_weights(clean_dir)
    if not ours:
        return False, "no final weights"
    differs = []
    if ours.keys() != theirs.keys() or not all(torch.equal(ours[k], theirs[k]) for k in ours):
        worst = max(float((ours[k] - theirs[k]).abs().max()) for k in ours if k in theirs)
        differs.append(f"weights (max |diff| {worst:.3g})")
    mine, clean = records(run_dir, "metrics.jsonl"), records(clean_dir, "metrics.jsonl")
    timing = ("timing/", "throughput/", "async/", "memory/")  # what a restart or a retry changes in any run
    keys = sorted({(m["step"], k) for m, c in zip(mine, clean) for k in m
                   if not k.startswith(timing) and k not in RECOVERY_COUNTS
                   and m.get(k) != c.get(k)})
    if len(mine) != len(clean):
        differs.append(f"{len(mine)} steps logged, not {len(clean)}")
    if keys:
        differs.append("metrics: " + ", ".join(f"{k} (step {s})" for s, k in keys[:3])
                       + (f" and {len(keys) - 3} more" if len(keys) > 3 else ""))
    return not differs, "; ".join(differs)


def prompts(run_dir: Path) -> collections.Counter:
    """How often each prompt row was drawn by the steps whose work the run kept (the last record of a step)."""
    last = {r["step"]: r["rows"] for r in records(run_dir, "prompts.jsonl")}
    return collections.Counter(row for rows in last.values() for row in rows)


def measure(fault: Fault, launches: list[Launch], run_dir: Path, clean_dir: Path) -> Row:
    row = Row(fault.name, fault.what, fault.faults, launches=len(launches), exit_codes=[x.code for x in launches],
              wall_s=round(sum(x.seconds for x in launches), 1), inexact_because=fault.inexact)
    lines = [(sum(x.seconds for x in launches[:k]) + t, line) for k, x in enumerate(launches) for t, line in x.lines]
    fired = next((t for t, line in lines if "fault injected:" in line), None)
    if fired is not None:
        noticed = next((t for t, line in lines if t >= fired and "fault injected:" not in line
                        and re.search(fault.detect, line)), None)
        row.detected_s = None if noticed is None else round(noticed - fired, 2)
    restarts = sum("starting it again from its last checkpoint" in line for _, line in lines)  # launch/torchrun.sh's
    resumed = [int(m.group(1)) for _, line in lines if (m := re.search(r"resuming from \S+ \(step (\d+) of", line))]
    finished = [int(m.group(1)) for _, line in lines if (m := re.search(r"\brl step (\d+)/", line))]
    row.steps_recomputed = len(finished) - len(set(finished))
    metrics = records(run_dir, "metrics.jsonl")
    clean = records(clean_dir, "metrics.jsonl")
    row.engine_restarts = int(max((m.get("rollout/engine_restarts", 0) for m in metrics), default=0))
    row.env_retries = int(sum(m.get("env/retries", 0) for m in metrics))
    failed = sum(m.get("reward/failures", 0) for m in metrics) - sum(m.get("reward/failures", 0) for m in clean)
    row.samples_failed = int(failed)
    ours, theirs = prompts(run_dir), prompts(clean_dir)
    row.prompts_lost, row.prompts_repeated = sum((theirs - ours).values()), sum((ours - theirs).values())
    row.samples_lost = row.prompts_lost * N_SAMPLES
    code = launches[-1].code
    if code != 0:
        row.outcome = f"stopped (exit {code}): {last_error(lines)}"
    elif restarts or len(launches) > 1:
        how = "launched again, as a requeue" if len(launches) > 1 else "restarted by launch/torchrun.sh"
        row.outcome = f"resumed from step {resumed[-1] if resumed else 0} ({how})"
    else:
        row.outcome = "recovered in place"
    row.exact, row.differs = compare(run_dir, clean_dir)
    return row


def last_error(lines: list[tuple[float, str]]) -> str:
    """The last error a worker named: an exception's line or megarl's own message (torchrun prefixes its
    workers' lines with [rankN]:)."""
    named = []
    for _, line in lines:
        line = re.sub(r"^\[rank\d+\]: ", "", line)
        if re.match(r"(?:[\w.]+\.)?\w+(?:Error|Fault|Lost|Exception): ", line) and "ChildFailedError" not in line:
            named.append(line)
        elif line.startswith("megarl: ") and not line.startswith(("megarl: raised in", "megarl: done")):
            named.append(line[len("megarl: "):])
    return named[-1][:200] if named else "no error named"


# ---- the table ---------------------------------------------------------------------------------------------


def markdown(rows: list[Row]) -> str:
    head = "| fault | outcome | detected (s) | prompts lost / repeated | samples failed | steps recomputed | " \
           "exact |\n|---|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r.fault} | {r.outcome} | {'—' if r.detected_s is None else r.detected_s} | "
        f"{r.prompts_lost} / {r.prompts_repeated} | {r.samples_failed} | {r.steps_recomputed} | {exactness(r)} |\n"
        for r in rows)
    return head + body


def exactness(row: Row) -> str:
    if not row.launches:
        return "—"
    if row.exact:
        return "yes"
    if row.inexact_because:
        return f"no, by design: {row.inexact_because}"
    return f"no: {row.differs}"


def available(module: str | None, python: str) -> bool:
    if module is None:
        return True
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the runs and the table")
    parser.add_argument("--quick", action="store_true", help="the faults marked quick only")
    parser.add_argument("--only", nargs="*", default=None, help="faults whose name contains one of these")
    parser.add_argument("--python", default=sys.executable, help="the environment's python (torchrun beside it)")
    args = parser.parse_args()
    out: Path = args.out.resolve()
    chosen = [f for f in FAULTS if (not args.quick or f.quick)
              and (args.only is None or any(o.lower() in f.name.lower() for o in args.only))]
    assets = out / "assets"
    if not (assets / "model" / "config.json").exists():
        subprocess.run([args.python, str(REPO / "tools" / "make_tiny_model.py"), "--out", str(assets / "model"),
                        "--arch", "qwen2", "--seed", "0", "--hidden", "128", "--layers", "2", "--heads", "8",
                        "--kv-heads", "4", "--ffn", "256"], check=True)
    if not (assets / "data" / "train.jsonl").exists():
        subprocess.run([args.python, "-m", "megarl.data.arithmetic", "--out", str(assets / "data"), "--seed", "0"],
                       check=True)
    base = [*BASE, f"model.path={assets / 'model'}", f"data.train_path={assets / 'data' / 'train.jsonl'}"]
    rows: list[Row] = []
    clean: dict[str, Path] = {}
    for fault in chosen:
        if not available(fault.needs, args.python):
            rows.append(Row(fault.name, fault.what, fault.faults, outcome=f"not run: {fault.needs} is not installed"))
            print(f"fault_matrix: {fault.name}: not run ({fault.needs} is not installed)", flush=True)
            continue
        layout = [*base, *LAYOUTS[fault.layout]]
        if fault.layout not in clean:
            clean[fault.layout] = out / f"clean-{fault.layout}"
            print(f"fault_matrix: the fault-free run ({fault.layout})", flush=True)
            first = run(clean[fault.layout], layout, python=args.python)
            if first[-1].code != 0:
                tail = "\n".join(line for _, line in first[-1].lines[-30:])
                sys.exit(f"fault_matrix: the fault-free run failed (exit {first[-1].code}):\n{tail}")
        run_dir = out / re.sub(r"[^a-z0-9]+", "-", fault.name.lower()).strip("-")
        print(f"fault_matrix: {fault.name}", flush=True)
        injected = "faults=" + json.dumps(fault.faults)
        launches = run(run_dir, [*layout, *fault.overrides, injected], python=args.python,
                       corrupt_before_relaunch=fault.corrupt_before_relaunch)
        rows.append(measure(fault, launches, run_dir, clean[fault.layout]))
        print(f"  {rows[-1].outcome}; detected in {rows[-1].detected_s} s; exact: {rows[-1].exact} {rows[-1].differs}",
              flush=True)
    (out / "fault_matrix.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    (out / "fault_matrix.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
