"""metrics.jsonl across a resume: records after the resumed step are dropped (they are recomputed), and a
partial last record, left by a run killed while writing it, is dropped with a warning instead of stopping
the resume."""

from __future__ import annotations

import json
import logging

from megarl.metrics import MetricsWriter


def open_writer(run_dir, *, resume_step: int) -> MetricsWriter:
    return MetricsWriter(run_dir, total_steps=5, enabled=True, progress=False, tensorboard=False,
                         resume_step=resume_step)


def test_resume_keeps_the_records_up_to_its_step(tmp_path):
    writer = open_writer(tmp_path, resume_step=0)
    for step in (1, 2, 3):
        writer.write(step, {"loss": float(step)})
    writer.close()
    writer = open_writer(tmp_path, resume_step=2)
    writer.write(3, {"loss": 30.0})
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 30.0}]


def test_a_partial_last_record_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="megarl.metrics"):
        writer = open_writer(tmp_path, resume_step=2)
    writer.write(3, {"loss": 3.0})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert any(f"{path}:3: dropping a partial record" in r.getMessage() for r in caplog.records)
