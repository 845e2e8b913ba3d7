"""The GPU device check's wiring, without a GPU: the wheels it carries plus what the check machine already
holds cover every requirement of megarl, at the versions constraints.txt pins; its runner refuses to start
without the bundle and names the step that makes it. (`bash tools/device_check/run.sh --dry-run` runs every
stage on the CPU; it takes minutes, so it is not part of the suite.)
"""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO, setup_requirements

pytestmark = pytest.mark.timeout(60)

# What the check machine's image holds of megarl's requirements (torch 2.11 with CUDA, transformers 5.17 and
# their dependencies, Python 3.12): the rest must travel as wheels.
MACHINE_HAS = {"torch", "transformers", "tokenizers", "safetensors", "pyyaml", "numpy", "psutil", "tqdm"}


def name(requirement: str) -> str:
    return re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def bundle_names() -> list[str]:
    """The distributions tools/device_check/prepare.sh downloads."""
    script = (REPO / "tools" / "device_check" / "prepare.sh").read_text()
    return [name(n) for n in re.search(r"^missing=\((.*)\)$", script, re.M)[1].split()]


def test_carried_wheels_and_the_machine_cover_every_requirement_of_megarl():
    install_requires, _ = setup_requirements()
    needed = {name(r) for r in install_requires}
    bundle = set(bundle_names())
    assert needed - MACHINE_HAS <= bundle, needed - MACHINE_HAS - bundle
    assert not bundle & MACHINE_HAS  # a second copy of the machine's own packages would replace them
    # math-verify's own requirements travel too (sympy is torch's)
    assert {"latex2sympy2-extended", "antlr4-python3-runtime"} <= bundle


def test_every_carried_wheel_is_pinned_in_constraints():
    pinned = {name(line): line for line in (REPO / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    for dist in bundle_names():
        assert dist in pinned and "==" in pinned[dist], dist


def test_runner_without_the_bundle_says_how_to_make_it(tmp_path):
    # A copy of the runner in a checkout-shaped directory without .device_wheels
    (tmp_path / "tools" / "device_check").mkdir(parents=True)
    runner = tmp_path / "tools" / "device_check" / "run.sh"
    runner.write_text((REPO / "tools" / "device_check" / "run.sh").read_text())
    result = subprocess.run(["bash", str(runner), "--dry-run", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "tools/device_check/prepare.sh" in result.stderr
