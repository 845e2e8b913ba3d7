"""The step timeline (log.trace) of a tiny run: one Chrome-trace event per phase per step per rank, each
step enclosing its phases; `megarl trace` merges the ranks' files and reads one a killed run cut short. The
profiler window (log.profile_steps) of the same run traces its steps only."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import run_python
from megarl.timeline import Timeline, TraceError, merge_traces, read_trace
from test_cli import megarl_train, read_metrics, write_recipe

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory, qwen2_dir, arithmetic_dir) -> Path:
    """RUN_DIR of a 3-step tiny run (no warm start, no final checkpoint) with log.trace on and the profiler
    over step 2."""
    root = tmp_path_factory.mktemp("traced")
    run_dir = root / "run"
    recipe = write_recipe(root / "tiny.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir,
                          extra="  trace: true\n  profile_steps: [2, 2]\n")
    result = megarl_train(recipe, "warmup.sft_steps=0", "checkpoint.save_final=false", cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def test_trace_has_one_event_per_phase_per_step_inside_its_step(traced_run):
    trace = json.loads((traced_run / "trace" / "rank0-from-step1.json").read_text())  # plain JSON when finished
    spans = [e for e in trace if e["ph"] == "X" and "step" in e.get("args", {})]
    assert {e["pid"] for e in trace} == {0}
    records = read_metrics(traced_run)
    for record in records:
        n = record["step"]
        phases = {k[len("timing/"):-len("_s")] for k in record if k.startswith("timing/") and k.endswith("_s")}
        events = [e for e in spans if e["args"]["step"] == n]
        # this recipe times each phase once a step: one event each, plus the step itself
        assert Counter(e["name"] for e in events) == Counter([*phases, "step"]), (n, events)
        step = next(e for e in events if e["name"] == "step")
        for e in events:
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
            # ts is wall-clock, dur monotonic: allow a millisecond of clock disagreement
            assert step["ts"] - 1000 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1000, e
            if e is not step:  # the timeline's durations are the phase times the metrics report
                assert e["dur"] / 1e6 == pytest.approx(record[f"timing/{e['name']}_s"], abs=1e-5)
    assert [r["step"] for r in records] == [1, 2, 3]


def test_the_profiler_window_traces_its_steps_only(traced_run):
    assert [p.name for p in (traced_run / "profile").iterdir()] == ["rank0.steps2-2.json"]
    events = json.loads((traced_run / "profile" / "rank0.steps2-2.json").read_text())["traceEvents"]
    marks = {e["name"] for e in events if e.get("name", "").startswith("megarl step ")}
    assert marks == {"megarl step 2"}
    assert len(events) > 100  # the step's operators, not the mark alone


@pytest.mark.parametrize("window", ["[3, 2]", "[0, 1]", "[2]"])
def test_a_bad_profile_window_is_an_error_naming_the_key(window, tmp_path, qwen2_dir, arithmetic_dir):
    from megarl.config import load_config
    from megarl.dataclass_yaml import ConfigError

    recipe = write_recipe(tmp_path / "tiny.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"tiny.yaml.*log.profile_steps: must be \[first, last\] steps"):
        load_config(str(recipe), [f"log.profile_steps={window}"])


def write_rank(path: Path, rank: int, *, steps: int) -> None:
    timeline = Timeline()
    timeline.start(path, rank=rank)
    for n in range(1, steps + 1):
        with timeline.step(n):
            timeline.add("generate", start_s=1e9 + n, seconds=0.5)
    timeline.close()


def test_megarl_trace_merges_the_ranks_into_one_file_keeping_each_pid(tmp_path):
    for rank in (0, 1):
        write_rank(tmp_path / "trace" / f"rank{rank}-from-step1.json", rank, steps=2)
    result = run_python(["-m", "megarl", "trace", str(tmp_path), "--out", str(tmp_path / "job.json")], timeout_s=60)
    assert result.returncode == 0, result.stderr
    merged = json.loads((tmp_path / "job.json").read_text())["traceEvents"]
    spans = [e for e in merged if e["ph"] == "X"]
    assert Counter((e["pid"], e["name"]) for e in spans) == {(0, "step"): 2, (0, "generate"): 2,
                                                              (1, "step"): 2, (1, "generate"): 2}
    names = {e["pid"]: e["args"]["name"] for e in merged if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}


def test_a_trace_cut_short_by_a_killed_run_is_read_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "trace" / "rank0-from-step1.json"
    write_rank(path, 0, steps=2)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-3]) + "\n" + lines[-3][:10])  # no closing ], a partial last event
    assert [e["name"] for e in read_trace(path)] == ["process_name", "generate", "step", "generate"]
    assert merge_traces(tmp_path, tmp_path / "out.json") == (1, 4)
    path.write_text("[\n{oops},\n" + "\n".join(lines[1:]))
    with pytest.raises(TraceError, match=r"rank0-from-step1.json:2: not a trace event"):
        read_trace(path)


def test_megarl_trace_without_trace_files_exits_2_naming_the_key(tmp_path, capsys):
    from megarl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["trace", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "megarl: trace error:" in err and "no trace files" in err and "log.trace: true" in err
