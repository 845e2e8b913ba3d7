"""`megarl report` on a synthetic metrics.jsonl with the keys a run writes: every chart whose series exist
is a real PNG, a chart without its series is not drawn, the summary links them; without matplotlib or without
metrics the command says what is missing and exits 2."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from megarl.cli import main

STEPS = 12
PHASES = ("generate", "reward", "logprobs", "train", "push", "eval")


def write_run(run_dir: Path) -> None:
    """A GRPO run in split placement, as metrics.jsonl holds it: eval every 4 steps, no entropy logged, a
    NaN grad norm at step 5 (written as a string), and the start-up time in the first record only."""
    run_dir.mkdir()
    lines = []
    for n in range(1, STEPS + 1):
        record = {"step": n, "reward/mean": 0.2 + 0.05 * n, "loss": 0.1 / n, "kl": 0.001 * n,
                  "grad_norm": "nan" if n == 5 else 1.0 + math.sin(n), "response/len_mean": 30.0 - n,
                  "throughput/tokens_per_s": 1200.0 + 10 * n, "async/staleness_mean": 0.5,
                  "async/staleness_max": 1.0, "timing/reward_hidden_frac": 0.9,
                  **{f"timing/{phase}_s": 0.1 * (i + 1) for i, phase in enumerate(PHASES)}}
        if n % 4 == 0:
            record["eval/reward_mean"] = 0.1 * n
        if n == 1:
            record["timing/startup_seconds"] = 12.0
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "recipe.yaml").write_text("model:\n  path: /models/tiny\nalgo:\n  name: grpo\n")


def test_report_draws_every_chart_with_series_and_a_summary_linking_them(tmp_path, capsys):
    from PIL import Image

    run_dir = tmp_path / "run"
    write_run(run_dir)
    with pytest.raises(SystemExit) as e:
        main(["report", str(run_dir)])
    assert e.value.code == 0, capsys.readouterr().err
    out = run_dir / "report"
    charts = {"reward.png", "loss.png", "kl.png", "grad_norm.png", "response_length.png", "throughput.png",
              "staleness.png", "timing.png"}  # no entropy.png: the run logs no entropy
    assert {p.name for p in out.iterdir()} == charts | {"report.md"}
    for name in charts:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, (name, len(data))
        image = Image.open(out / name).convert("L")
        assert image.size == (640, 360)
        # the axes alone are black on white; drawn series add colours that grey out to many levels
        assert sum(1 for count in image.histogram() if count) > 20, name
    summary = (out / "report.md").read_text()
    for name in charts:
        assert f"]({name})" in summary
    assert "12 logged steps" in summary and "algorithm `grpo`" in summary
    assert "| `eval/reward_mean` | 0.4 | 1.2 | 0.4 | 1.2 |" in summary  # the steps it was measured at only
    assert "| `grad_norm` |" in summary and "entropy" not in summary
    assert "A step takes 2.1 s" in summary and "eval 0.6 s (29%)" in summary
    assert "startup" not in summary and "hidden_frac" not in summary
    assert f"in {out / 'report.md'}" in capsys.readouterr().out


def test_report_without_matplotlib_says_what_to_install_and_exits_2(tmp_path, capsys, monkeypatch):
    write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path / "run")])
    assert e.value.code == 2
    assert "pip install -e '.[report]'" in capsys.readouterr().err


def test_report_without_metrics_exits_2_naming_the_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path)])
    assert e.value.code == 2
    assert f"megarl: report error: {tmp_path / 'metrics.jsonl'}: no metrics file" in capsys.readouterr().err
