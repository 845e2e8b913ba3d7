"""`megarl train` end to end in a subprocess on a tiny model: metrics, rollout/trainer agreement, the
exported checkpoint, overrides, and recipe or data errors that exit with code 2 naming file and key/line."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_python, subprocess_env

pytestmark = pytest.mark.timeout(180)

TRAIN_TIMEOUT_S = 150  # a 3-step tiny run takes ~7 s alone; leave room for a loaded 2-core machine
PHASES = ("generate", "reward", "logprobs", "advantages", "train", "push")
REQUIRED_METRICS = ("step", "reward/mean", "loss", "kl", "clipfrac", "grad_norm", "rollout/logprob_diff_mean",
                    "rollout/logprob_diff_max", "throughput/tokens_per_s", "eval/reward_mean",
                    *(f"timing/{phase}_s" for phase in PHASES))


def write_recipe(path: Path, *, model_dir: Path, data_dir: Path, run_dir: Path, train_path: Path | None = None,
                 extra: str = "") -> Path:
    path.write_text(
        f"model:\n  path: {model_dir}\n"
        f"data:\n  train_path: {train_path or data_dir / 'train.jsonl'}\n"
        f"  eval_path: {data_dir / 'heldout.jsonl'}\n  prompts_per_step: 4\n  eval_prompts: 8\n"
        f"run_dir: {run_dir}\n"
        "rollout:\n  n_samples: 4\n  max_new_tokens: 4\n"
        "train:\n  steps: 3\n  micro_batch_size: 8\n"
        "algo:\n  kl_coef: 0.01\n"
        "warmup:\n  sft_steps: 2\n  batch_size: 8\n"
        "log:\n  progress: false\n" + extra
    )
    return path


def megarl_train(recipe: Path, *overrides: str, cwd: Path, timeout_s: float = TRAIN_TIMEOUT_S):
    return run_python(["-m", "megarl", "train", str(recipe), *overrides], cwd=cwd, timeout_s=timeout_s)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, qwen2_dir, arithmetic_dir) -> Path:
    """RUN_DIR of one 3-step run of the tiny recipe (with a 2-step supervised warm start)."""
    root = tmp_path_factory.mktemp("cli_run")
    run_dir = root / "run"
    recipe = write_recipe(root / "tiny.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir)
    result = megarl_train(recipe, cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def test_train_writes_finite_metrics_for_every_step(trained_run):
    records = read_metrics(trained_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        missing = [k for k in REQUIRED_METRICS if k not in record]
        assert not missing, missing
        bad = {k: v for k, v in record.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
        assert not bad, bad
        assert record["throughput/tokens_per_s"] > 0
    # the process's start-up (imports, models, the warm start, the first push) is in its first record only
    assert records[0]["timing/startup_seconds"] > 0
    assert not any("timing/startup_seconds" in r for r in records[1:])


def test_rollout_logprobs_match_the_trainer_every_step(trained_run):
    # The native engine and the trainer compute the same fp32 function on the same pushed weights.
    for record in read_metrics(trained_run):
        assert 0 <= record["rollout/logprob_diff_mean"] <= record["rollout/logprob_diff_max"] <= 1e-4, record


def test_final_checkpoint_loads_in_transformers_and_recipe_is_saved(trained_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = trained_run / "checkpoints" / "final"
    model = AutoModelForCausalLM.from_pretrained(str(final))
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    assert model.config.model_type == "qwen2"
    assert tokenizer.decode(tokenizer("12+34=")["input_ids"]) == "12+34="
    assert (trained_run / "recipe.yaml").is_file()


def test_console_without_a_terminal_logs_one_line_per_logged_step(tmp_path, qwen2_dir, arithmetic_dir):
    """stderr is a pipe here: no progress bar (carriage returns), a summary line per logged step with phase
    times, the warm start's early end said as such, and no final checkpoint claimed when none is written."""
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "tiny.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir)
    result = megarl_train(recipe, "log.progress=true", "train.steps=4", "log.every_steps=2",
                          "warmup.stop_answer_prob=1e-30", "checkpoint.save_final=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "\r" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("rl step ")]
    assert [ln.split(" | ")[0] for ln in lines] == ["rl step 2/4", "rl step 4/4"], result.stderr[-4000:]
    for line in lines:
        assert "reward " in line and "loss " in line and " tok/s" in line and "generate " in line, line
        assert re.search(r" \| ETA \d+(\.\d)? (s|min|h)$", line), line
    assert lines[-1].endswith("| ETA 0 s")
    # the warm start's progress reaches the log file too: its first step at once, then one line per 30 s
    warm = [ln for ln in result.stderr.splitlines() if ln.startswith("sft warm start step ")]
    assert len(warm) == 1 and re.fullmatch(r"sft warm start step 1/2 \| nll \S+ answer_prob \S+ \| ETA \S+ s", warm[0])
    assert "megarl: sft warm start: stopped early after 1 of 2 steps: answer probability" in result.stderr
    assert "final checkpoint in" not in result.stdout and "no final checkpoint" in result.stdout
    assert not (run_dir / "checkpoints" / "final").exists()


def test_train_without_a_recipe_prints_its_usage(capsys):
    from megarl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: megarl train") and "recipe YAML file" in err and "required" not in err


def test_megarl_alone_prints_its_usage_and_version_prints_the_version(capsys):
    from megarl import __version__
    from megarl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: megarl") and "train" in err and "plan" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"megarl {__version__}\n"


def test_command_line_override_takes_effect(tmp_path, qwen2_dir, arithmetic_dir):
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / "tiny.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir)
    result = megarl_train(recipe, "train.steps=2", "warmup.sft_steps=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["train"]["steps"] == 2
    assert not (run_dir / "warmup").exists()


def test_a_non_finite_loss_stops_the_run_with_its_batch_saved_and_no_checkpoint(tmp_path, qwen2_dir,
                                                                                arithmetic_dir):
    """A critic learning rate of 1e30 makes Adam's first update ~1e30 per weight, so the step-2 values, and
    with them the critic loss, overflow fp32. The run must stop at step 2, keep step 1's checkpoint as
    `latest`, write no step-2 checkpoint or metrics, and save the step's rollout batch so it can be replayed.
    The length-penalty reward (every response is cut at max_new_tokens) makes the returns non-zero."""
    run_dir = tmp_path / "run"
    extra = ("checkpoint:\n  every_steps: 1\n"
             "reward:\n  terms:\n    - {kind: length_penalty, weight: 1.0, max_tokens: 4, cache_tokens: 3}\n")
    recipe = write_recipe(tmp_path / "tiny.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir,
                          extra=extra)
    result = megarl_train(recipe, "algo.name=ppo", "critic.lr=1e30", "warmup.sft_steps=0", cwd=tmp_path)
    assert result.returncode != 0
    bad = run_dir / "bad_batch_step2_rank0.pt"
    assert "step 2: critic loss" in result.stderr and f"is not finite; the batch is saved to {bad}" in result.stderr
    from megarl.batch import RolloutBatch

    batch = RolloutBatch.load(bad)
    assert batch.tokens.shape[0] == 16 and bool(batch.returns.abs().sum() > 0)  # 4 prompts x 4 samples
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step")) == ["step00000001"]
    assert (checkpoints / "latest").read_text().strip() == "step00000001"


# Each case: (text appended to the recipe, overrides, substrings stderr must name).
CONFIG_ERRORS = {
    "unknown_key_in_file": ("optim:\n  lrr: 0.001\n", [], ["optim.lrr", "unknown key", "did you mean 'lr'"]),
    "unknown_key_as_override": ("", ["rollout.temprature=0.5"], ["rollout.temprature", "unknown key",
                                                                  "override 'rollout.temprature=0.5'"]),
    "wrong_type": ("checkpoint:\n  every_steps: often\n", [], ["checkpoint.every_steps", "expected int", "'often'"]),
    "impossible_value": ("", ["rollout.temperature=0"], ["rollout.temperature", "must be > 0"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_recipe_error_exits_2_naming_file_and_key(case, tmp_path, qwen2_dir, arithmetic_dir):
    extra, overrides, expected = CONFIG_ERRORS[case]
    recipe = write_recipe(tmp_path / "bad.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir,
                          run_dir=tmp_path / "run", extra=extra)
    result = megarl_train(recipe, *overrides, cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2, result.stderr
    for text in (str(recipe), *expected):
        assert text in result.stderr, (text, result.stderr)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_missing_model_dir_exits_2_naming_file_and_key(tmp_path, arithmetic_dir):
    missing = tmp_path / "no_such_model"
    recipe = write_recipe(tmp_path / "bad.yaml", model_dir=missing, data_dir=arithmetic_dir,
                          run_dir=tmp_path / "run")
    result = megarl_train(recipe, cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2, result.stderr
    for text in (str(recipe), "model.path", str(missing)):
        assert text in result.stderr, (text, result.stderr)
    assert "Traceback" not in result.stderr


def test_model_dir_without_config_json_exits_2_naming_model_path(tmp_path, qwen2_dir, arithmetic_dir):
    model = tmp_path / "model"
    shutil.copytree(qwen2_dir, model)
    (model / "config.json").unlink()
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=model, data_dir=arithmetic_dir, run_dir=tmp_path / "run")
    result = megarl_train(recipe, cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2, result.stderr[-4000:]
    assert f"model.path: {model} is not an HF checkpoint directory: it has no config.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_run_dir_that_cannot_be_written_exits_2_before_any_work(tmp_path, qwen2_dir, arithmetic_dir):
    # a path under a regular file cannot be created, whoever runs the test (root ignores permissions)
    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "a_file" / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir)
    result = megarl_train(recipe, "--log-level=INFO", cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2, result.stderr[-4000:]
    assert f"run_dir: cannot write to {run_dir}: Not a directory" in result.stderr
    assert "supervised warm start" not in result.stderr and "Traceback" not in result.stderr  # before the warm start


def test_a_full_disk_during_a_checkpoint_says_so_and_where(tmp_path, qwen2_dir, arithmetic_dir):
    """run_dir on an 800 KiB tmpfs (mounted in a user and mount namespace of its own): the first checkpoint
    (~1.5 MB) cannot fit."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here to mount a small tmpfs in")
    small = tmp_path / "small"
    small.mkdir()
    run_dir = small / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir,
                          extra="checkpoint:\n  every_steps: 1\n")
    script = (f"mount -t tmpfs -o size=800k tmpfs {small} && exec {sys.executable} -m megarl train {recipe} "
              "warmup.sft_steps=0 data.eval_path=null train.steps=2")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, env=subprocess_env(),
                            capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S)
    assert result.returncode == 2, result.stderr[-4000:]
    tmp_dir = run_dir / "checkpoints" / f".tmp-step{1:08d}"
    assert f"megarl: checkpoint error: the disk is full: writing {tmp_dir} failed with" in result.stderr, \
        result.stderr[-4000:]
    assert "of 0.8 MiB on that filesystem" in result.stderr


def test_a_run_whose_every_reward_fails_stops_naming_the_term_and_its_error(tmp_path, qwen2_dir, arithmetic_dir):
    """A reward that returns the string "1.0" fails every sample; with reward.max_failed_steps=2 the run
    stops in step 2, before its metrics, with exit code 1."""
    run_dir = tmp_path / "run"
    extra = "reward:\n  max_failed_steps: 2\n  terms:\n    - {kind: custom, function: 'reward_fns:returns_text'}\n"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=run_dir,
                          extra=extra)
    result = run_python(["-m", "megarl", "train", str(recipe), "warmup.sft_steps=0", "train.steps=4"],
                        cwd=Path(__file__).parent, timeout_s=TRAIN_TIMEOUT_S)  # reward_fns imports from tests/
    assert result.returncode == 1, result.stderr[-4000:]
    assert ("megarl: reward error: every reward failed in 2 consecutive steps (up to step 2; "
            "reward.max_failed_steps=2)") in result.stderr, result.stderr[-4000:]
    assert "reward.terms[0] (reward_fns:returns_text): returned '1.0' (str), not a number" in result.stderr
    assert "Traceback" not in result.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1] and records[0]["reward/failed_frac"] == 1.0
    assert records[0]["reward/mean"] == 0.0


def test_malformed_data_row_exits_2_naming_file_and_line(tmp_path, qwen2_dir, arithmetic_dir):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n'
                     '{"prompt": "3+3=", "answer": "6"}\n')
    recipe = write_recipe(tmp_path / "bad_data.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir,
                          run_dir=tmp_path / "run", train_path=train)
    result = megarl_train(recipe, cwd=tmp_path, timeout_s=120)
    assert result.returncode == 2, result.stderr[-4000:]
    assert f"{train}:2" in result.stderr and "invalid JSON" in result.stderr, result.stderr[-4000:]
    assert "Traceback" not in result.stderr


def test_layout_that_does_not_divide_the_world_exits_2(tmp_path, qwen2_dir, arithmetic_dir):
    """A layout that cannot split the launch stops before any work, naming both numbers and the file."""
    recipe = write_recipe(tmp_path / "bad.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir,
                          run_dir=tmp_path / "run")
    result = megarl_train(recipe, "parallel.tp=2", cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2, result.stderr
    assert "world size 1 is not divisible by parallel.tp * parallel.pp * parallel.cp = 2" in result.stderr
    assert str(recipe) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_experts_that_do_not_divide_by_ep_exit_2(tmp_path, arch_dir, arithmetic_dir):
    """4 experts cannot split over parallel.ep=3: the launch stops before any work, naming both numbers."""
    recipe = write_recipe(tmp_path / "bad.yaml", model_dir=arch_dir("mixtral"), data_dir=arithmetic_dir,
                          run_dir=tmp_path / "run")
    result = megarl_train(recipe, "parallel.ep=3", cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2, result.stderr
    assert "experts 4 is not divisible by parallel.ep = 3" in result.stderr
    assert str(recipe) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_chat_template_prompts_are_token_ids_of_the_rendered_turn(qwen2_dir):
    from transformers import AutoTokenizer

    from megarl.data.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    ids = encode_prompt(tokenizer, "12+35=", chat_template=True)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == "<|im_start|>user\n12+35=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(encode_prompt(tokenizer, "12+35=", chat_template=False)) == "12+35="


def test_a_reward_model_term_scores_every_sample(tmp_path, qwen2_dir, arithmetic_dir):
    """reward.terms with a reward_model: the run trains on its scores (a random scalar head gives every
    sample a different, non-zero reward) and logs them like any reward."""
    from conftest import with_score_head

    rm = with_score_head(qwen2_dir, tmp_path / "rm", seed=7)
    recipe = write_recipe(tmp_path / "rm.yaml", model_dir=qwen2_dir, data_dir=arithmetic_dir, run_dir=tmp_path / "run",
                          extra=f"reward:\n  terms:\n    - {{kind: reward_model, path: {rm}, weight: 2.0}}\n")
    result = megarl_train(recipe, "train.steps=2", "warmup.sft_steps=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = read_metrics(tmp_path / "run")
    assert len(steps) == 2 and all(m["reward/mean"] != 0 and m["grad_norm"] > 0 for m in steps)
