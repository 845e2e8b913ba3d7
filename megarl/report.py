"""`megarl report RUN_DIR`: a run's curves as PNG charts and a one-page Markdown summary, from
`RUN_DIR/metrics.jsonl` (and the run's `recipe.yaml`, when there). matplotlib is the `report` extra and is
imported only here, when the charts are drawn.

    written = write_report(Path("runs/quickstart/run"), out_dir=Path("runs/quickstart/run/report"))

A chart is drawn only when at least one of its series has a number in some record: an SFT run has no reward
chart, a colocated run no staleness chart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from megarl.metrics import complete_records


class ReportError(ValueError):
    """A run directory without readable metrics; the message names the file."""


@dataclass(frozen=True)
class Chart:
    file: str  # the PNG's name in the report folder
    title: str
    series: tuple[tuple[str, str], ...]  # (metrics key, legend label), drawn as lines against the step
    ylabel: str


CHARTS = (
    Chart("reward.png", "Reward", (("reward/mean", "train"), ("eval/reward_mean", "held-out")), "reward"),
    Chart("loss.png", "Loss", (("loss", "train"), ("eval/loss", "held-out")), "loss"),
    Chart("kl.png", "KL to the reference", (("kl", "token mean"), ("kl/seq_mean", "sequence mean")), "KL"),
    Chart("entropy.png", "Entropy", (("entropy", "policy"),), "nats per token"),
    Chart("grad_norm.png", "Gradient norm", (("grad_norm", "policy"), ("critic/grad_norm", "critic")), "norm"),
    Chart("response_length.png", "Response length", (("response/len_mean", "mean"),), "tokens"),
    Chart("throughput.png", "Throughput", (("throughput/tokens_per_s", "tokens/s"),), "tokens / s"),
    Chart("staleness.png", "Staleness (split placement)",
          (("async/staleness_mean", "mean"), ("async/staleness_max", "max")), "weight versions"),
)
TIMING_CHART = "timing.png"  # the phases of a step (`timing/<phase>_s`), stacked


def read_records(path: Path) -> list[dict]:
    """The step records of a metrics file; a NaN or inf, written as a string, is read back as a float."""
    if not path.is_file():
        raise ReportError(f"{path}: no metrics file (a run writes it from its first logged step)")
    records = [{k: _number(v) for k, v in record.items()} for _, record in complete_records(path)]
    if not records:
        raise ReportError(f"{path}: no step records yet")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a number under `key`."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def phase_keys(records: list[dict]) -> list[str]:
    """The `timing/<phase>_s` keys of the records, longest phase (in total) first."""
    totals: dict[str, float] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("timing/") and key.endswith("_s") and isinstance(value, (int, float)):
                totals[key] = totals.get(key, 0.0) + value
    return sorted(totals, key=lambda k: -totals[k])


def write_report(run_dir: Path, *, out_dir: Path) -> list[Path]:
    """Draw every chart whose series exist and write `report.md` beside them in `out_dir`; returns the
    files written (the summary last). Raises ReportError without metrics, ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    records = read_records(run_dir / "metrics.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for chart in CHARTS:
        lines = [(label, *series(records, key)) for key, label in chart.series]
        lines = [line for line in lines if line[1]]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for label, steps, values in lines:
            ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
        _finish(ax, chart.title, chart.ylabel, legend=len(lines) > 1)
        written.append(_save(fig, out_dir / chart.file))
    phases = phase_keys(records)
    if phases:
        timed = [r for r in records if any(k in r for k in phases)]
        steps = [r["step"] for r in timed]
        stacks = [[_finite(r.get(k, 0.0)) for r in timed] for k in phases]
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        ax.stackplot(steps, stacks, labels=[k[len("timing/"):-len("_s")] for k in phases])
        _finish(ax, "Time of a step by phase", "seconds", legend=True)
        written.append(_save(fig, out_dir / TIMING_CHART))
    summary = out_dir / "report.md"
    summary.write_text(summary_markdown(run_dir, records, [p.name for p in written]), encoding="utf-8")
    return [*written, summary]


def summary_markdown(run_dir: Path, records: list[dict], charts: list[str]) -> str:
    """One page: the run, its headline numbers (first, last, best of each charted series), where a step's
    time goes, and the charts."""
    recipe = run_dir / "recipe.yaml"
    cfg = yaml.safe_load(recipe.read_text(encoding="utf-8")) if recipe.is_file() else {}
    algo = (cfg.get("algo") or {}).get("name", "?")
    model = (cfg.get("model") or {}).get("path", "?")
    out = [f"# Run report: {run_dir}", "",
           f"{len(records)} logged steps (last: step {records[-1]['step']}); algorithm `{algo}`; model `{model}`.", "",
           "| metric | first | last | min | max |", "|---|---|---|---|---|"]
    for chart in CHARTS:
        for key, _ in chart.series:
            _, values = series(records, key)
            finite = [v for v in values if math.isfinite(v)]
            if finite:
                out.append(f"| `{key}` | {values[0]:.4g} | {values[-1]:.4g} | {min(finite):.4g} | {max(finite):.4g} |")
    phases = phase_keys(records)
    if phases:
        means = {k: sum(series(records, k)[1]) / len(records) for k in phases}
        total = sum(means.values())
        out += ["", f"A step takes {total:.3g} s on average (over the logged steps): "
                + ", ".join(f"{k[len('timing/'):-len('_s')]} {v:.3g} s ({v / total:.0%})" for k, v in means.items()
                            if total > 0) + "."]
    out += ["", *(f"![{name[:-len('.png')]}]({name})" for name in charts), ""]
    return "\n".join(out)


def _finish(ax, title: str, ylabel: str, *, legend: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the plot, not over it


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _number(value):
    """metrics.jsonl writes a non-finite float as a string ('nan', 'inf'): read it back as one."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
