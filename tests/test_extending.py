"""docs/extending.md works as written: each of its code blocks is saved under the name in the comment above it
(`<!-- file: NAME -->`), and

- the reward and the environment train a step of the page's recipe with megarl as it is;
- the algorithm and architecture patches apply to a copy of this checkout, where the tests they add to pass
  (the page's OPO test, and tests/test_engine.py's checks of InternLM3 against transformers);
- that copy trains a step of the new algorithm on a tiny checkpoint of the new architecture, the trainer's
  logprobs equal to the rollout engine's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_python, subprocess_env

PAGE = REPO / "docs" / "extending.md"
RUN_TIMEOUT_S = 240
BLOCKS = {"my_rewards.py", "my_envs.py", "extend_tiny.yaml", "opo.patch", "test_algo_opo.py", "internlm3.patch"}


def page_files() -> dict[str, str]:
    """NAME -> text of every fenced block the page marks with `<!-- file: NAME -->`."""
    blocks = re.findall(r"^<!-- file: (\S+) -->\n```\w*\n(.*?)^```$", PAGE.read_text(), re.M | re.S)
    names = [name for name, _ in blocks]
    assert len(names) == len(set(names)), f"{PAGE}: a file name marks two blocks: {names}"
    return dict(blocks)


def write_files(directory: Path, names) -> None:
    files = page_files()
    for name in names:
        (directory / name).write_text(files[name])


def apply_patch(diff: str, root: Path) -> None:
    """Apply a unified diff (`git diff` output) under `root`, strictly: every hunk's old lines must appear in
    its file exactly once. (The CPU image has neither git nor patch.)"""
    for part in re.split(r"^diff --git .*\n", diff, flags=re.M)[1:]:
        path = re.search(r"^\+\+\+ b/(\S+)$", part, re.M)[1]
        target = root / path
        text = target.read_text()
        for hunk in re.split(r"^@@ [^\n]*@@[^\n]*\n", part, flags=re.M)[1:]:
            lines = hunk.splitlines()
            old = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "-"))
            new = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "+"))
            assert text.count(old) == 1, f"{PAGE.name}: a hunk of {path} no longer matches the code:\n{old}"
            text = text.replace(old, new)
        target.write_text(text)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that runs megarl or pytest on its own (no xdist worker's settings)."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("PYTEST_")}
    return env | extra


def train(recipe: Path, overrides: list[str], *, cwd: Path, pythonpath: list[Path]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "megarl", "train", str(recipe), *overrides], cwd=cwd,
                          env=child_env(PYTHONPATH=os.pathsep.join(map(str, pythonpath))), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step, = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()]
    return step


def recipe_overrides(model: Path, data: Path) -> list[str]:
    return ["run_dir=run", f"model.path={model}", f"data.train_path={data / 'train.jsonl'}"]


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    """A copy of megarl, its tools and tests with the page's two patches applied, and the page's OPO test."""
    root = tmp_path_factory.mktemp("patched")
    for folder in ("megarl", "tools", "tests"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    files = page_files()
    apply_patch(files["opo.patch"], root)
    apply_patch(files["internlm3.patch"], root)
    (root / "tests" / "test_algo_opo.py").write_text(files["test_algo_opo.py"])
    return root


def test_every_marked_block_is_exercised():
    assert set(page_files()) == BLOCKS


def test_the_reward_and_the_environment_behave_as_the_page_says(tmp_path):
    write_files(tmp_path, ["my_rewards.py", "my_envs.py"])
    modules = {}
    for name in ("my_rewards", "my_envs"):
        spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    exact_with_digits, DigitsOnly = modules["my_rewards"].exact_with_digits, modules["my_envs"].DigitsOnly

    assert exact_with_digits(prompt="140+872=", response="9130\n", answer="9130", metadata={}) == 1.1
    assert exact_with_digits(prompt="140+872=", response="91ab", answer="9130", metadata={}) == 0.05
    env = DigitsOnly(penalty=0.2)
    env.reset("140+872=", {})
    again = env.step("ninety<|im_end|>")
    assert not again.done and again.reward == -0.2 and again.observation == [
        "Try 1 is not a number: answer with digits only."]
    assert env.step(" 9130<|im_end|>").done


def test_the_reward_and_the_environment_train_a_step(qwen2_dir, arithmetic_dir, tmp_path):
    write_files(tmp_path, ["my_rewards.py", "my_envs.py", "extend_tiny.yaml"])
    step = train(tmp_path / "extend_tiny.yaml", recipe_overrides(qwen2_dir, arithmetic_dir), cwd=tmp_path,
                 pythonpath=[tmp_path, REPO])
    assert step["env/turns_mean"] > 1  # the environment asked again
    assert step["reward/failures"] == 0
    # the shaping term and the step rewards vary within groups: the step trains
    assert step["train/trained_frac"] > 0 and step["grad_norm"] > 0


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_the_patched_checkout_passes_the_tests_of_the_new_algorithm_and_architecture(patched):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "tests/test_algo_opo.py", "tests/test_engine.py", "-k", "opo or internlm3"],
                          cwd=patched, env=child_env(PYTHONPATH=str(patched)), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed[1]) >= 5, proc.stdout[-2000:]  # OPO's test and at least InternLM3's four


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_the_new_algorithm_trains_a_step_on_the_new_architecture(patched, arithmetic_dir, tmp_path):
    model = tmp_path / "internlm3"
    made = run_python([str(patched / "tools" / "make_tiny_model.py"), "--arch", "internlm3", "--out", str(model)],
                      cwd=patched, env={"PYTHONPATH": str(patched)})
    assert made.returncode == 0, made.stderr
    assert json.loads((model / "config.json").read_text())["model_type"] == "internlm3"
    write_files(tmp_path, ["my_rewards.py", "my_envs.py", "extend_tiny.yaml"])
    step = train(tmp_path / "extend_tiny.yaml", [*recipe_overrides(model, arithmetic_dir), "algo.name=opo"],
                 cwd=tmp_path, pythonpath=[tmp_path, patched])
    assert step["rollout/logprob_diff_max"] < 1e-4  # the trainer's InternLM3 is the engine's
    assert step["train/trained_frac"] > 0 and step["grad_norm"] > 0
