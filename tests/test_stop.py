"""Stopping a real `megarl train` subprocess: SIGTERM (or SIGUSR1) finishes the step, saves it, prints the
resume command and exits 143, and the run resumes from that checkpoint; a second Ctrl-C stops at once
(exit 130, no traceback); under torchrun a signal to one rank stops every rank after the same step with
one complete checkpoint; and SIGKILL leaves no process of the run behind.

Every run is the tiny RL recipe (no warm start, no evaluation): about 0.5 s per step here, so a signal
sent after the first metrics line lands early in a run of STEPS steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import subprocess_env

STEPS = 12
RUN_TIMEOUT_S = 150  # a tiny run starts in ~10 s alone; leave room for a loaded 2-core machine
pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT_S)


def write_recipe(path: Path, *, model_dir: Path, data_dir: Path) -> Path:
    path.write_text(
        f"model:\n  path: {model_dir}\n"
        f"data:\n  train_path: {data_dir / 'train.jsonl'}\n  prompts_per_step: 4\n"
        "rollout:\n  n_samples: 4\n  max_new_tokens: 4\n"
        f"train:\n  steps: {STEPS}\n  micro_batch_size: 8\n"
        "reward:\n  terms:\n    - {kind: length_penalty, max_tokens: 4, cache_tokens: 3}\n"
        "checkpoint:\n  every_steps: 0\n"
        "log:\n  progress: false\n"
    )
    return path


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, qwen2_dir, arithmetic_dir) -> Path:
    return write_recipe(tmp_path_factory.mktemp("stop") / "rl.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir)


def start(args: list[str], run_dir: Path, *, launcher: list[str] | None = None) -> subprocess.Popen:
    """`megarl train ARGS run_dir=RUN_DIR` in its own session, stderr to RUN_DIR.stderr."""
    err = open(f"{run_dir}.stderr", "w")
    cmd = [*(launcher or [sys.executable]), "-m", "megarl", "train", *args, f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=run_dir.parent, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err,
                            start_new_session=True)
    err.close()
    return proc


def wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.01)


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def stderr_of(run_dir: Path) -> str:
    return Path(f"{run_dir}.stderr").read_text()


def latest(run_dir: Path) -> str | None:
    pointer = run_dir / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def test_sigterm_saves_the_step_exits_143_and_the_printed_command_resumes(recipe, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([str(recipe)], run_dir)
    wait_for(lambda: steps_logged(run_dir) >= 1, proc, "the first step")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 143, stderr_of(run_dir)[-3000:]
    err = stderr_of(run_dir)
    stopped = steps_logged(run_dir)
    assert 1 <= stopped < STEPS
    assert latest(run_dir) == f"step{stopped:08d}"  # the finished step is saved although every_steps is 0
    assert f"stopped by SIGTERM after step {stopped}" in err and "Traceback" not in err, err[-3000:]
    command = err.split("(checkpoint.resume: auto): ")[1].splitlines()[0]
    assert command == f"megarl train {recipe} run_dir={run_dir}"

    resumed = subprocess.run([sys.executable, "-m", *command.split()], cwd=tmp_path, env=subprocess_env(),
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / f'step{stopped:08d}'}" in resumed.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(recipe, tmp_path):
    run_dir = tmp_path / "run"
    proc = start([str(recipe)], run_dir)
    wait_for(lambda: steps_logged(run_dir) >= 1, proc, "the first step")
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: "Ctrl-C again to stop at once" in stderr_of(run_dir), proc, "the first Ctrl-C's notice")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=RUN_TIMEOUT_S) == 130
    err = stderr_of(run_dir)
    assert "megarl: interrupted; no checkpoint was saved" in err and "Traceback" not in err, err[-3000:]
    assert latest(run_dir) is None  # it did not wait to save the step it was in


def test_a_signal_to_one_torchrun_rank_stops_every_rank_after_the_same_step(recipe, tmp_path):
    run_dir = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = start([str(recipe)], run_dir, launcher=torchrun)
    wait_for(lambda: steps_logged(run_dir) >= 1, proc, "the first step")
    workers = [p for p in psutil.Process(proc.pid).children() if "megarl" in p.cmdline()]
    rank1 = [p for p in workers if p.environ().get("RANK") == "1"]
    assert len(workers) == 2 and len(rank1) == 1, [p.cmdline() for p in workers]
    rank1[0].send_signal(signal.SIGUSR1)
    proc.wait(timeout=RUN_TIMEOUT_S)
    err = stderr_of(run_dir)
    stopped = steps_logged(run_dir)
    assert f"stopped by SIGTERM or SIGUSR1 after step {stopped}" in err, err[-3000:]  # rank 0's report
    assert "exitcode  : 143" in err  # torchrun's summary of the workers
    saved = run_dir / "checkpoints" / f"step{stopped:08d}"
    assert latest(run_dir) == saved.name
    assert sorted(p.name for p in saved.glob("rank*.pt")) == ["rank00000.pt", "rank00001.pt"]


def test_sigkill_leaves_no_process_of_the_run_behind(recipe, tmp_path):
    """Megatron's checkpoint writer used to start a multiprocessing Manager (and a resource tracker) that
    outlived a killed run; every process the run starts shares its session, so none may remain."""
    run_dir = tmp_path / "run"
    proc = start([str(recipe), "checkpoint.every_steps=1"], run_dir)
    wait_for(lambda: latest(run_dir) is not None and steps_logged(run_dir) >= 2, proc, "a checkpoint")
    os.kill(proc.pid, signal.SIGKILL)  # the run's process only, as the OOM killer or a crash would
    proc.wait()

    def session() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == proc.pid:
                    found.append(p)
            except (ProcessLookupError, PermissionError):
                pass
        return found

    deadline = time.monotonic() + 10  # a writer mid-file finishes its file first
    while session() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = session()
    for p in left:  # clean up before failing
        p.kill()
    assert not left, [" ".join(p.cmdline()) for p in left]
