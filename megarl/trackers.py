"""Experiment trackers beside metrics.jsonl: a Weights & Biases run (`log.wandb`) and an MLflow run
(`log.mlflow`), opened by the logging rank only.

    trackers = open_trackers(cfg, resume_step=start)     # [] when neither section is in the recipe
    for t in trackers: t.log(step, metrics)              # every logged step, the numbers of metrics.jsonl
    for t in trackers: t.close(finished=True)

Each run gets the run name, the resolved recipe and the source commit as its config (W&B) or params (MLflow).
A tracker run's id is kept in RUN_DIR/trackers.json: a resumed run (resume_step > 0) reattaches to it, a
fresh run starts a new one, as metrics.jsonl starts over. wandb and mlflow are imported here only, when
their section is present.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

from megarl.config import Config, MlflowConfig, WandbConfig
from megarl.dataclass_yaml import config_to_dict

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
# MLflow refuses a param value longer than this (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH)
MLFLOW_PARAM_CHARS = 6000


def open_trackers(cfg: Config, *, resume_step: int) -> list:
    """The trackers the recipe turns on, each with its run started (or, after `resume_step` > 0, the run of
    RUN_DIR/trackers.json reattached); their ids are written back to that file."""
    run_dir = Path(cfg.run_dir)
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text(encoding="utf-8")) if resume_step and ids_path.exists() else {}
    info = run_info(cfg)
    trackers = []
    try:
        if cfg.log.wandb is not None:
            trackers.append(WandbTracker(cfg.log.wandb, run_dir=run_dir, info=info, run_id=ids.get("wandb")))
        if cfg.log.mlflow is not None:
            trackers.append(MlflowTracker(cfg.log.mlflow, run_dir=run_dir, info=info, run_id=ids.get("mlflow")))
    except BaseException:
        for tracker in trackers:
            tracker.close(finished=False)
        raise
    if trackers:
        run_dir.mkdir(parents=True, exist_ok=True)
        ids.update({t.key: t.run_id for t in trackers})
        ids_path.write_text(json.dumps(ids, indent=1) + "\n", encoding="utf-8")
    return trackers


def run_info(cfg: Config) -> dict:
    """What identifies a run besides its numbers: its name (run_dir's), the resolved recipe, and megarl's
    source commit (null outside a git checkout) with whether the checkout had uncommitted changes."""
    from megarl import __version__

    commit, dirty = source_commit()
    return {"run_name": Path(cfg.run_dir).resolve().name, "recipe": config_to_dict(cfg),
            "megarl": {"version": __version__, "commit": commit, "dirty": dirty}}


def source_commit() -> tuple[str | None, bool | None]:
    """(HEAD commit, has uncommitted changes) of the git checkout megarl is imported from; (None, None)
    for an installed package or without git."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def _import(key: str, module: str, extra: str):
    """`module` imported, or a RuntimeError naming the recipe key that needs it and the install command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:  # an optional extra
        raise RuntimeError(f"{key} is set but {module} is not installed: pip install -e '.[{extra}]' -c "
                           f"constraints.txt in the megarl checkout") from e


def _numbers(metrics: dict) -> dict[str, float]:
    """The numeric entries of a metrics record (bools and strings are left to metrics.jsonl)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbTracker:
    """One W&B run; its files (and, offline, the whole run) under RUN_DIR/wandb."""

    key = "wandb"

    def __init__(self, cfg: WandbConfig, *, run_dir: Path, info: dict, run_id: str | None):
        wandb = _import("log.wandb", "wandb", "wandb")
        run_dir.mkdir(parents=True, exist_ok=True)
        # resume="allow" continues the run `run_id` names (a resumed job) and starts it when there is none
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or info["run_name"],
                              group=cfg.group, tags=cfg.tags or None, mode=cfg.mode, dir=str(run_dir),
                              id=run_id, resume="allow" if run_id else None, reinit="create_new")
        # a resumed job may run with a changed recipe (more steps) or code: its values replace the first ones
        self.run.config.update({**info["recipe"], "run_name": info["run_name"], "megarl": info["megarl"]},
                               allow_val_change=True)
        self.run_id = self.run.id

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self, *, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class MlflowTracker:
    """One MLflow run, through an MlflowClient of its own (no process-wide active run)."""

    key = "mlflow"

    def __init__(self, cfg: MlflowConfig, *, run_dir: Path, info: dict, run_id: str | None):
        _import("log.mlflow", "mlflow", "mlflow")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
        tags = {**cfg.tags, "mlflow.source.git.commit": info["megarl"]["commit"] or "unknown"}
        if run_id is None:
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(cfg.experiment))
            run_id = self.client.create_run(experiment_id, run_name=cfg.name or info["run_name"]).info.run_id
            logged = {}
        else:
            try:
                self.client.update_run(run_id, status="RUNNING")
            except Exception as e:
                e.add_note(f"log.mlflow: reattaching the run {run_id} of {run_dir / IDS_FILE} "
                           f"(tracking_uri {self.client.tracking_uri})")
                raise
            logged = self.client.get_run(run_id).data.params
        self.run_id = run_id
        params = flat_params({**info["recipe"], "run_name": info["run_name"], "megarl": info["megarl"]})
        # MLflow keeps a param's first value: a resumed run logs only the params it lacks
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("log.mlflow: run %s keeps its first values of %s", run_id, ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=new[i:i + 100])
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        recipe = run_dir / "recipe.yaml"
        if recipe.exists():
            self.client.log_artifact(run_id, str(recipe))

    def log(self, step: int, metrics: dict) -> None:
        import time

        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(k, v, now_ms, step) for k, v in _numbers(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self, *, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts as `a.b.c` -> str(value) (None as "null", lists as JSON), each value cut to MLflow's
    limit."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, f"{name}."))
            continue
        text = "null" if v is None else json.dumps(v) if isinstance(v, (list, dict)) else str(v)
        out[name] = text[:MLFLOW_PARAM_CHARS]
    return out
