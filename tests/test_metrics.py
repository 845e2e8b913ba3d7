"""metrics.jsonl and prompts.jsonl across a resume: records after the resumed step are dropped (they are
recomputed), and a partial last record, left by a run killed while writing it, is dropped with a warning
instead of stopping the resume."""

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


def test_each_steps_prompt_rows_go_to_prompts_jsonl_every_step_and_not_into_the_metrics(tmp_path):
    """A step's "data/rows" is a list, not a metric: prompts.jsonl gets it at every step (`rows`), whatever
    log.every_steps writes to metrics.jsonl; a resumed run keeps the rows of the steps up to its own."""
    writer = open_writer(tmp_path, resume_step=0)
    for step in (1, 2, 3):
        metrics = {"loss": float(step), "data/rows": [step, 10 + step]}
        writer.rows(step, metrics)
        if step != 2:  # as log.every_steps leaves a step out
            writer.write(step, metrics)
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "loss": 1.0}, {"step": 3, "loss": 3.0}]
    writer = open_writer(tmp_path, resume_step=2)
    writer.rows(3, {"data/rows": [7, 8]})
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "rows": [1, 11]}, {"step": 2, "rows": [2, 12]}, {"step": 3, "rows": [7, 8]}]


def test_a_run_without_rows_writes_no_prompts_file(tmp_path):
    writer = open_writer(tmp_path, resume_step=0)
    writer.rows(1, {"loss": 1.0})
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not (tmp_path / "prompts.jsonl").exists()
