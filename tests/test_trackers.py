"""Trackers (log.wandb, log.mlflow), offline: each run holds the run name, the resolved recipe and the source
commit as its config/params and every logged step's numbers; a resumed run continues the same tracker run and
a fresh one starts another; a missing package or a bad section is an error naming the key. Read back with the
trackers' own readers: MLflow's client on a file store, W&B's `wandb leet inspect` of the offline run's log.
One tiny `megarl train` run shows the loop logging on both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from megarl.config import load_config
from megarl.dataclass_yaml import ConfigError
from megarl.trackers import open_trackers
from test_cli import megarl_train, read_metrics, write_recipe

pytestmark = pytest.mark.timeout(180)

STEPS = {1: {"loss": 0.5, "reward/mean": 0.25, "timing/train_s": 1.5},
         2: {"loss": 0.25, "reward/mean": 0.5, "timing/train_s": 1.25},
         3: {"loss": 0.125, "reward/mean": 0.75, "timing/train_s": 1.0}}


def offline_env(root: Path) -> dict[str, str]:
    """W&B offline and quiet with every file it writes under `root`; MLflow's file store allowed (MLflow 3
    refuses it unless asked)."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(root / "wandb_home"),
            "WANDB_CONFIG_DIR": str(root / "wandb_home" / "config"), "WANDB_CACHE_DIR": str(root / "wandb_home"),
            "WANDB_DATA_DIR": str(root / "wandb_home"), "MLFLOW_ALLOW_FILE_STORE": "true"}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """Every test, and the processes it starts, offline (offline_env)."""
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)


def recipe(path: Path, run_dir: Path, mlruns: Path, *overrides: str):
    """A config with both trackers on (W&B offline, MLflow on a file store under `mlruns`); its model and data
    paths are not looked at."""
    path.write_text("model:\n  path: /no/model\ndata:\n  train_path: /no/train.jsonl\n"
                    f"run_dir: {run_dir}\nlog:\n  wandb: {{project: tiny, mode: offline, tags: [t1]}}\n"
                    f"  mlflow: {{tracking_uri: 'file:{mlruns}', experiment: tiny-exp, tags: {{team: rl}}}}\n")
    return load_config(path, overrides, check_paths=False)


def log_steps(trackers, steps, *, finished: bool) -> None:
    for n in steps:
        for tracker in trackers:
            tracker.log(n, {**STEPS[n], "lr_frozen": True, "note": "text"})
    for tracker in trackers:
        tracker.close(finished=finished)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A job that logs steps 1-2 and dies, is resumed from step 2 and logs step 3 (a longer recipe: 3 steps),
    then starts over fresh in the same run_dir. Returns (cfg, ids of the first job, ids of the fresh one)."""
    pytest.importorskip("wandb", reason="the test extra installs wandb")
    pytest.importorskip("mlflow", reason="the test extra installs mlflow-skinny")
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in offline_env(root).items():
            mp.setenv(key, value)
        cfg = recipe(root / "r.yaml", root / "run", root / "mlruns", "train.steps=2")
        (root / "run").mkdir()
        (root / "run" / "recipe.yaml").write_text("train:\n  steps: 2\n")
        first = open_trackers(cfg, resume_step=0)
        log_steps(first, [1, 2], finished=False)
        resumed = open_trackers(recipe(root / "r.yaml", root / "run", root / "mlruns", "train.steps=3"),
                                resume_step=2)
        log_steps(resumed, [3], finished=True)
        fresh = open_trackers(cfg, resume_step=0)
        log_steps(fresh, [], finished=True)
    ids = lambda trackers: {t.key: t.run_id for t in trackers}  # noqa: E731
    assert ids(resumed) == ids(first)
    return cfg, ids(first), ids(fresh)


def wandb_records(run_dir: Path, run_id: str) -> list[list[dict]]:
    """The records of each offline W&B run with id `run_id` under run_dir/wandb, oldest first, as wandb's own
    reader of the run's transaction log prints them (offline: it reports nothing to W&B either)."""
    out = []
    env = os.environ | offline_env(run_dir.parent)
    for path in sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}")):
        text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                              capture_output=True, text=True, timeout=60, check=True, env=env).stdout
        out.append([json.loads(line) for line in text.splitlines() if line.strip()])
    return out


def git_head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_wandb_offline_run_has_the_recipe_commit_and_every_step(runs):
    cfg, first, _ = runs
    jobs = wandb_records(Path(cfg.run_dir), first["wandb"])
    assert len(jobs) == 2  # the first job and its resumption, one offline run each, one run id
    for records, steps, exit_code, train_steps in ((jobs[0], [1, 2], 1, 2), (jobs[1], [3], 0, 3)):
        run = next(r["run"] for r in records if r["type"] == "run")
        assert (run["run_id"], run["project"], run["display_name"]) == (first["wandb"], "tiny", "run")
        assert run["tags"] == ["t1"]
        config = {}
        for r in records:
            if r["type"] == "config":
                config.update(r["config"].get("update", {}))
        assert config["run_name"] == "run" and config["run_dir"] == cfg.run_dir
        assert config["log"]["wandb"]["project"] == "tiny" and config["algo"]["name"] == cfg.algo.name
        assert config["train"]["steps"] == train_steps  # the resumed job's recipe replaces the first's
        assert config["megarl"]["commit"] == git_head()
        history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
        assert sorted(history) == steps
        for n in steps:
            # numbers only: the bool and the string stay in metrics.jsonl
            assert {k: v for k, v in history[n].items() if not k.startswith("_")} == STEPS[n]
        assert next(r["exit"]["exit_code"] for r in records if r["type"] == "exit") == exit_code


def test_mlflow_run_has_the_recipe_commit_and_every_step_across_the_resume(runs):
    from mlflow.tracking import MlflowClient

    cfg, first, fresh = runs
    client = MlflowClient(tracking_uri=cfg.log.mlflow.tracking_uri)
    run = client.get_run(first["mlflow"])
    assert client.get_experiment(run.info.experiment_id).name == "tiny-exp"
    assert run.info.run_name == "run" and run.info.status == "FINISHED"  # the resumed job finished it
    params = run.data.params
    assert params["run_name"] == "run" and params["run_dir"] == cfg.run_dir
    assert params["algo.name"] == cfg.algo.name and params["log.mlflow.experiment"] == "tiny-exp"
    assert params["train.steps"] == "2"  # MLflow keeps the first job's value
    assert params["megarl.commit"] == git_head()
    assert run.data.tags["mlflow.source.git.commit"] == git_head() and run.data.tags["team"] == "rl"
    for key in ("loss", "reward/mean", "timing/train_s"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted((m.step, m.value) for m in history) == [(n, STEPS[n][key]) for n in (1, 2, 3)]
    assert client.get_metric_history(run.info.run_id, "note") == []
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert artifacts == ["recipe.yaml"]


def test_a_fresh_run_in_the_same_run_dir_starts_new_tracker_runs(runs):
    cfg, first, fresh = runs
    assert fresh["wandb"] != first["wandb"] and fresh["mlflow"] != first["mlflow"]
    assert json.loads((Path(cfg.run_dir) / "trackers.json").read_text()) == fresh


@pytest.mark.parametrize("key,module", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_tracker_package_names_the_key_and_the_install(key, module, tmp_path, monkeypatch):
    other = "mlflow" if key == "wandb" else "wandb"
    cfg = recipe(tmp_path / "r.yaml", tmp_path / "run", tmp_path / "mlruns", f"log.{other}=null")
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    with pytest.raises(RuntimeError, match=rf"log.{key} is set but {module} is not installed: "
                                           rf"pip install -e '\.\[{key}\]' -c constraints.txt"):
        open_trackers(cfg, resume_step=0)
    assert not (tmp_path / "run" / "trackers.json").exists()


@pytest.mark.parametrize("override,message", [
    ("log.wandb.mode=cloud", r"log.wandb.mode: expected one of 'online', 'offline', got 'cloud'"),
    ("log.wandb.project=''", r"log.wandb.project: must not be empty"),
    ("log.mlflow.tracking_url=x", r"log.mlflow.tracking_url: unknown key \(did you mean 'tracking_uri'\?\)"),
    ("log.mlflow.tags=[a]", r"log.mlflow.tags: expected dict\[str, str\]"),
])
def test_a_bad_tracker_section_is_an_error_naming_the_key(override, message, tmp_path):
    with pytest.raises(ConfigError, match=r"r.yaml: override .*: " + message):
        recipe(tmp_path / "r.yaml", tmp_path / "run", tmp_path / "mlruns", override)


def test_trackers_are_off_unless_their_section_is_given(tmp_path):
    (tmp_path / "r.yaml").write_text(f"model:\n  path: /m\ndata:\n  train_path: /t.jsonl\nrun_dir: {tmp_path}\n")
    cfg = load_config(tmp_path / "r.yaml", check_paths=False)
    assert cfg.log.wandb is None and cfg.log.mlflow is None
    assert open_trackers(cfg, resume_step=0) == [] and not (tmp_path / "trackers.json").exists()
    cfg = load_config(tmp_path / "r.yaml", ["log.wandb.mode=offline", "log.mlflow={}"], check_paths=False)
    assert (cfg.log.wandb.project, cfg.log.wandb.name, cfg.log.mlflow.experiment) == ("megarl", None, "megarl")


@pytest.mark.timeout(300)  # the tiny models, then a train run with room for a loaded machine
def test_megarl_train_logs_each_step_of_metrics_jsonl_to_both_trackers(tmp_path, qwen2_dir, arithmetic_dir):
    pytest.importorskip("wandb", reason="the test extra installs wandb")
    pytest.importorskip("mlflow", reason="the test extra installs mlflow-skinny")
    from mlflow.tracking import MlflowClient

    run_dir, mlruns = tmp_path / "run", tmp_path / "mlruns"
    trackers = f"  wandb: {{mode: offline}}\n  mlflow: {{tracking_uri: 'file:{mlruns}'}}\n"
    path = write_recipe(tmp_path / "tiny.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir,
                        extra=trackers)
    result = megarl_train(path, "warmup.sft_steps=0", "train.steps=2", "checkpoint.save_final=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(run_dir)
    ids = json.loads((run_dir / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=f"file:{mlruns}")
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    (job,) = wandb_records(run_dir, ids["wandb"])
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in job if r["type"] == "history"}
    assert sorted(history) == [r["step"] for r in records] == [1, 2]
    for record in records:
        n = record["step"]
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        assert numbers and {k: history[n][k] for k in numbers} == pytest.approx(numbers)
        for key in ("loss", "reward/mean", "grad_norm"):
            logged = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], key)}
            assert logged[n] == pytest.approx(record[key])

