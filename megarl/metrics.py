"""Run observability: per-phase timers, `RUN_DIR/metrics.jsonl`, console progress, TensorBoard, and the
trackers of megarl.trackers (W&B, MLflow).

Console progress is a bar on a terminal and one summary line per logged step elsewhere (a log file, a
pipe), where a bar would be carriage returns; each line ends with the run's ETA, and the warm start, which logs
no steps, prints its own progress lines. Only the logging rank (global rank 0) writes; every rank may
time phases.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megarl.timeline import TIMELINE

log = logging.getLogger(__name__)


def check_finite(metrics: dict[str, float], *, step: int, what: str, keep: Callable[[], str] | None = None) -> None:
    """A NaN or inf `loss` or `grad_norm` stops the run with a FloatingPointError naming the step, before the
    step reaches a checkpoint. `keep` saves what replays the step and says where (the RL loop saves its
    rollout batch, which cannot be regenerated); offline data is replayed by resuming the last checkpoint."""
    if math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]):
        return
    kept = f"; {keep()}" if keep is not None else ""
    raise FloatingPointError(f"step {step}: {what} loss {metrics['loss']}, grad norm {metrics['grad_norm']} "
                             f"is not finite{kept}")


class PhaseTimer:
    """`with timer("generate"): ...` records `timing/generate_s`; phases keep their first-use order. An error
    raised inside a phase (a collective that timed out, say) carries a note naming the phase. With `log.trace`
    each phase is also an event of the step timeline (megarl.timeline)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start, start_s = time.perf_counter(), time.time()
        try:
            yield
        except Exception as e:
            e.add_note(f"megarl: raised in the {phase!r} phase of the step, "
                       f"{time.perf_counter() - start:.1f} s after it began")
            raise
        finally:
            seconds = time.perf_counter() - start
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
            TIMELINE.add(phase, start_s=start_s, seconds=seconds)

    def metrics(self) -> dict[str, float]:
        return {f"timing/{phase}_s": s for phase, s in self.seconds.items()}


def _continued(path: Path, resume_step: int):
    """`path` (one JSON record per step) open for appending: emptied for a fresh run (`resume_step` 0); for a
    resumed one, the records up to `resume_step` kept and those after it (recomputed) and a partial last one
    (a run killed while writing it) dropped, with a warning."""
    kept = []
    if resume_step and path.exists():
        kept = [line for line, record in complete_records(path) if record["step"] <= resume_step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return path.open("a", encoding="utf-8")


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl; shows the key numbers on the console (a progress
    bar on a terminal, else a `summary_line` per logged step) and passes each record to the `trackers`
    (megarl.trackers), which it closes. A step's "data/rows" (the prompt rows it drew, every rank's: a list,
    not a metric) goes to prompts.jsonl instead, {"step", "rows"}, so a run can be checked for prompts skipped
    or seen twice."""

    CONSOLE_KEYS = ("reward/mean", "eval/reward_mean", "loss", "reward_accuracy", "eval/loss", "kl", "grad_norm")

    def __init__(self, run_dir: str | Path, *, total_steps: int, enabled: bool, progress: bool,
                 tensorboard: bool, desc: str = "rl", resume_step: int = 0, trackers: Sequence = ()):
        """A fresh run (`resume_step` 0) starts metrics.jsonl over; a resumed one keeps the records of the
        steps up to `resume_step` and drops the ones a crash left after it, which are recomputed, and a
        partial record (a run killed while writing it), with a warning."""
        self.enabled = enabled
        self.desc, self.total_steps = desc, total_steps
        self._lines = progress and not sys.stderr.isatty()
        self._pace = Pace(total_steps, done=resume_step)
        self._bar = None
        self._tb = None
        self._file = self._rows = None
        self._trackers = list(trackers)
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = _continued(run_dir / "metrics.jsonl", resume_step)
        self._rows_at = (run_dir / "prompts.jsonl", resume_step)  # continued at the first step with rows (RL)
        if progress and not self._lines:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=resume_step, desc=desc, dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is an optional extra
                raise RuntimeError("log.tensorboard is true but tensorboard is not installed: "
                                   "pip install -e '.[tensorboard]' -c constraints.txt in the megarl checkout") from e
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        metrics = {k: v for k, v in metrics.items() if k != "data/rows"}
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        for tracker in self._trackers:
            tracker.log(step, metrics)
        if self._bar is not None:
            shown = {_label(k): f"{metrics[k]:.3g}" for k in self.CONSOLE_KEYS if k in metrics}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        if self._lines:
            line = summary_line(self.desc, step, self.total_steps, metrics, keys=self.CONSOLE_KEYS)
            print(f"{line} | {self._pace.eta(step)}", file=sys.stderr, flush=True)

    def rows(self, step: int, metrics: dict) -> None:
        """The step's "data/rows" into prompts.jsonl (every step, whatever log.every_steps)."""
        if self.enabled and (rows := metrics.get("data/rows")) is not None:
            self._rows = self._rows or _continued(*self._rows_at)
            self._rows.write(json.dumps({"step": step, "rows": rows}) + "\n")
            self._rows.flush()

    def close(self, *, finished: bool = True) -> None:
        """`finished` False: the run stopped on an error or a signal, which its trackers record."""
        for tracker in self._trackers:
            tracker.close(finished=finished)
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        for file in (self._file, self._rows):
            if file is not None:
                file.close()


class Pace:
    """The time left of a phase of `total` steps at the pace of the steps this process ran (from `done` on)."""

    def __init__(self, total: int, *, done: int = 0):
        self.total, self._done, self._start = total, done, time.monotonic()

    def eta(self, done: int) -> str:
        """`ETA 3.5 min` after `done` of the steps; `ETA ?` before the first."""
        ran = done - self._done
        if ran <= 0:
            return "ETA ?"
        return f"ETA {duration((time.monotonic() - self._start) / ran * max(self.total - done, 0))}"


class ProgressLines:
    """A long phase's progress where stderr is a log file rather than a terminal (a bar there would be carriage
    returns): a line after the first step, then at most one every `every_s` seconds, each with the ETA."""

    def __init__(self, desc: str, total: int, *, enabled: bool, every_s: float = 30.0):
        self.desc, self.total, self.every_s = desc, total, every_s
        self.enabled = enabled and not sys.stderr.isatty()
        self._pace, self._last = Pace(total), None

    def update(self, done: int, numbers: dict[str, float]) -> None:
        now = time.monotonic()
        if not self.enabled or (self._last is not None and now - self._last < self.every_s):
            return
        self._last = now
        line = summary_line(self.desc, done, self.total, numbers, keys=tuple(numbers))
        print(f"{line} | {self._pace.eta(done)}", file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """`42 s`, `3.5 min`, `2.1 h`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def summary_line(desc: str, step: int, total_steps: int, metrics: dict[str, float], *, keys: tuple[str, ...],
                 phases: int = 4) -> str:
    """One console line for a step: its key numbers, throughput, and its time with the `phases` longest
    phases, e.g. `rl step 3/40 | reward 0.25 loss 0.0123 | 1.2e+03 tok/s | 1.31 s: generate 0.61 train 0.4`."""
    numbers = " ".join(f"{_label(k)} {metrics[k]:.3g}" for k in keys if k in metrics)
    parts = [f"{desc} step {step}/{total_steps}", numbers]
    if "throughput/tokens_per_s" in metrics:
        parts.append(f"{metrics['throughput/tokens_per_s']:.3g} tok/s")
    timings = {k[len("timing/"):-len("_s")]: v for k, v in metrics.items()
               if k.startswith("timing/") and k.endswith("_s")}
    if "step" in timings:  # SFT and DPO time the whole step only
        parts.append(f"{timings['step']:.3g} s")
    elif timings:
        longest = sorted(timings.items(), key=lambda kv: -kv[1])[:phases]
        parts.append(f"{sum(timings.values()):.3g} s: " + " ".join(f"{k} {v:.2g}" for k, v in longest))
    return " | ".join(p for p in parts if p)


def _label(key: str) -> str:
    """The console's short name of a metric: `reward/mean` -> reward, `eval/...` -> eval, `a/b` -> b."""
    return "reward" if key == "reward/mean" else "eval" if key.startswith("eval/") else key.split("/")[-1]


def complete_records(path: Path) -> list[tuple[str, dict]]:
    """(line, its record) for the lines of metrics file `path` that hold a whole JSON record; others are
    dropped with a warning."""
    kept = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: dropping a partial record (the run stopped while writing it): %.80s", path,
                        line_no, line)
            continue
        kept.append((line, record))
    return kept


def _plain(value):
    """JSON has no NaN/inf: write them as strings so a bad value is visible, not a parse error."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
