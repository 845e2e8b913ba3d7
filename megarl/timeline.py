"""Where a step's time goes, per rank: a step timeline (`log.trace`) and a torch.profiler window
(`log.profile_steps`, class ProfileWindow).

The timeline is a Chrome-trace file (the Trace Event Format that Perfetto and chrome://tracing load) per
process, `RUN_DIR/trace/rank<R>-from-step<N>.json`: an "X" (complete) event for every step and for every
phase a PhaseTimer times inside it, pid = global rank, tid = the thread, ts and dur in microseconds (ts from
the Unix epoch, so the files of all ranks, and of a resumed run, share one clock). It is written in the
format's JSON-array form, one event per line as it ends: a run killed mid-step leaves a file that Perfetto
still loads (the closing `]` is optional there) and `merge_traces` reads. `megarl trace RUN_DIR` merges a
run's files into one.

    TIMELINE.start(path, rank=0)           # run_steps, on every rank with log.trace
    with TIMELINE.step(3): ...             # the enclosing event of step 3
    with PhaseTimer()("generate"): ...     # an event of the open step (megarl.metrics)
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import IO


class TraceError(ValueError):
    """A trace file or folder that cannot be read; the message names it."""


class Timeline:
    """The process's trace file; off (every call a no-op) until `start`."""

    def __init__(self):
        self._file: IO[str] | None = None
        self._step: int | None = None
        self._pid = 0
        self._lock = threading.Lock()  # phases may end on other threads (split placement's pushes)

    @property
    def on(self) -> bool:
        return self._file is not None

    def start(self, path: Path, *, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._pid = rank
        self._file = path.open("w", encoding="utf-8")
        self._file.write("[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})

    def close(self) -> None:
        if self._file is None:
            return
        self._emit({"name": "process_sort_index", "ph": "M", "pid": self._pid, "tid": 0,
                    "args": {"sort_index": self._pid}}, last=True)
        self._file.close()
        self._file = None

    def add(self, name: str, *, start_s: float, seconds: float) -> None:
        """An event `name` that began at Unix time `start_s` and lasted `seconds`, in the open step."""
        if self._file is None:
            return
        event = {"name": name, "ph": "X", "ts": round(start_s * 1e6), "dur": round(seconds * 1e6),
                 "pid": self._pid, "tid": threading.get_native_id()}
        if self._step is not None:
            event["args"] = {"step": self._step}
        self._emit(event)

    @contextlib.contextmanager
    def step(self, n: int):
        """Step `n`'s enclosing event (written when the step ends, raising or not); the phases timed inside
        it carry `args.step = n`."""
        self._step, start_s, began = n, time.time(), time.perf_counter()
        try:
            yield
        finally:
            self.add("step", start_s=start_s, seconds=time.perf_counter() - began)
            self._step = None

    def _emit(self, event: dict, *, last: bool = False) -> None:
        with self._lock:
            self._file.write(json.dumps(event) + ("\n]\n" if last else ",\n"))
            self._file.flush()


TIMELINE = Timeline()  # one per process, like its rank: PhaseTimer writes to it wherever a loop times a phase


class ProfileWindow:
    """torch.profiler over steps `first`..`last` (inclusive) of this rank, each step marked `megarl step N`;
    the trace of the window goes to `out_dir/rank<R>.steps<first>-<last>.json` (Chrome trace, which Perfetto
    and TensorBoard's profiler plugin open) when its last step ends, or when the run stops inside it. CPU
    activity, and CUDA's where there is a GPU. No steps (`window` None): every call a no-op."""

    def __init__(self, window: list[int] | None, out_dir: Path, *, rank: int):
        self.first, self.last = window or (0, -1)
        self.path = out_dir / f"rank{rank}.steps{self.first}-{self.last}.json"
        self._profiler = None

    @contextlib.contextmanager
    def step(self, n: int):
        if not self.first <= n <= self.last:
            yield
            return
        import torch

        if self._profiler is None:  # the window's first step, or the first after a resume inside it
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        with torch.profiler.record_function(f"megarl step {n}"):
            yield
        if n == self.last:
            self.close()

    def close(self) -> None:
        """Stop the profiler and write its trace, if it runs."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))


def global_rank() -> int:
    """This process's rank in the whole job: torchrun's RANK (in split placement the training ranks meet in a
    world of their own, whose ranks start at 0 again), else torch.distributed's, else 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def read_trace(path: Path) -> list[dict]:
    """The events of one rank's trace file, finished or cut short by a killed run (no closing `]`, a partial
    last line, which is dropped)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].strip() != "[":
        raise TraceError(f"{path}: not a megarl trace file (it should start with '[')")
    events = []
    for line_no, line in enumerate(lines[1:], start=2):
        text = line.strip().rstrip(",")
        if text in ("", "]"):
            continue
        try:
            events.append(json.loads(text))
        except json.JSONDecodeError as e:
            if line_no == len(lines):  # the line a killed run was writing
                break
            raise TraceError(f"{path}:{line_no}: not a trace event ({e.msg}): {text[:80]}") from e
    return events


def merge_traces(run_dir: Path, out: Path) -> tuple[int, int]:
    """Write every rank's trace file of `run_dir` into one Chrome-trace JSON object at `out`, events in time
    order. Returns (files merged, events)."""
    paths = sorted((run_dir / "trace").glob("rank*.json"))
    if not paths:
        raise TraceError(f"{run_dir / 'trace'}: no trace files (rank*.json); run with log.trace: true")
    events = [event for path in paths for event in read_trace(path)]
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0), -e.get("dur", 0)))  # a step before its phases
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}), encoding="utf-8")
    return len(paths), len(events)
