"""Every attack of tests/sandbox_attacks.py fails against the sandbox in its three modes: in this process's
mode and, when the tests run as root, as root without a cgroup ("rlimit" mode, each run a uid of its own) and
as an unprivileged user ("rlimit" mode, runs one at a time). Under CI the sandbox must be isolated:
missing bubblewrap or user namespaces fail these tests instead of skipping them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import sandbox_attacks

from megarl.rewards.sandbox import NOBODY


pytestmark = pytest.mark.usefixtures("isolated")  # skipped without isolation, failed in CI (conftest.py)


def test_ci_runs_the_sandbox_in_an_isolated_mode(isolated):
    assert isolated in ("cgroup", "rlimit")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attack", sorted(sandbox_attacks.ATTACKS))
def test_the_attack_fails(attack):
    sandbox_attacks.ATTACKS[attack]()


def _python_for_nobody() -> tuple[str, str] | None:
    """(interpreter, PYTHONPATH) with which the unprivileged user can run megarl's sandbox, or None."""
    site = sysconfig.get_paths()["purelib"]
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for python in (os.path.realpath(sys._base_executable), f"/usr/bin/python{version}"):
        check = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                "--clear-groups", python, "-c", "import megarl.rewards.sandbox as s; s.sandbox_mode()"],
                               env={"PYTHONPATH": f"{Path(__file__).parent.parent}:{site}"}, capture_output=True)
        if check.returncode == 0:
            return python, site
    return None


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_every_attack_fails_as_an_unprivileged_user():
    found = _python_for_nobody()
    if found is None:
        pytest.skip("no interpreter and site-packages the unprivileged user can read")
    python, site = found
    script = Path(sandbox_attacks.__file__)
    result = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                             "--clear-groups", python, str(script)],
                            env={"PYTHONPATH": site, "PATH": os.environ["PATH"]},
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["uid"] == NOBODY and report["mode"] in ("cgroup", "rlimit"), report
    assert report["failed"] == {}, "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.getuid() != 0, reason="a root trainer without a cgroup: needs root")
def test_every_attack_fails_in_rlimit_mode_for_a_root_trainer():
    """The third mode: a root trainer (each run a uid of its own) where no cgroup can be made."""
    result = subprocess.run([sys.executable, str(Path(sandbox_attacks.__file__)), "--no-cgroup"],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["uid"] == 0 and report["mode"] == "rlimit", report
    assert report["failed"] == {}, "\n".join(f"{k}:\n{v}" for k, v in report["failed"].items())
