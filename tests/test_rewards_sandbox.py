"""The code sandbox: passing and failing code, and hostile code (an infinite loop, a memory bomb, a fork
bomb, a network connection, a write outside its directory) contained, scored 0 and cleaned up."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megarl.config import SandboxConfig
from megarl.rewards.sandbox import code_reward, extract_code, namespaces_available, run_python

LIMITS = SandboxConfig(cpu_s=1, wall_s=6.0, memory_mb=256, output_bytes=4096)
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def running_processes() -> set[int]:
    """Our descendants, and every process on the machine running from a sandbox directory (a sandbox
    escapes our process tree when it daemonizes), by pid."""
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    return ours | {proc.pid for proc in psutil.process_iter(["cmdline"])
                   if any("megarl-sandbox-" in part for part in proc.info["cmdline"] or ())}


def sandbox_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("megarl-sandbox-*"))


@pytest.fixture(autouse=True)
def nothing_left_running():
    # only what appears during the test counts: the interpreter may keep helpers of its own (multiprocessing's
    # resource tracker), and another job on the machine may run sandboxes
    dirs, processes = sandbox_dirs(), running_processes()
    yield
    assert sorted(running_processes() - processes) == []
    assert sandbox_dirs() - dirs == set()


def test_correct_code_passes_and_wrong_code_fails():
    right = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert code_reward(right, TESTS, LIMITS) == 1.0
    assert code_reward("```python\ndef add(a, b):\n    return a - b\n```", TESTS, LIMITS) == 0.0
    assert code_reward("def add(a, b) return", TESTS, LIMITS) == 0.0  # a syntax error


def test_extract_code_takes_the_last_fence_else_the_whole_response():
    assert extract_code("```py\nx = 1\n```\ntext\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    start = time.monotonic()
    result = run_python("while True:\n    pass\n", LIMITS)
    elapsed = time.monotonic() - start
    assert not result.passed
    # SIGXCPU at cpu_s=1 (reported as 128 + 24); well before the 6 s wall-clock limit, with 3 s of slack
    # for the interpreter's start on a loaded machine.
    assert result.returncode == 128 + 24 and elapsed < 4.0, (result, elapsed)
    assert code_reward("def add(a, b):\n    while True:\n        pass\n", TESTS, LIMITS) == 0.0


def test_a_sleeping_program_is_killed_at_the_wall_clock_limit():
    limits = SandboxConfig(cpu_s=1, wall_s=1.5, memory_mb=256, output_bytes=4096)
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(60)\n", limits)
    assert result.returncode is None and time.monotonic() - start < 5.0


def test_a_memory_bomb_hits_the_address_space_limit():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))\n", LIMITS)
    assert not result.passed and "MemoryError" in result.stderr


def test_a_fork_bomb_is_refused():
    result = run_python("import os\nwhile True:\n    os.fork()\n", LIMITS)
    assert not result.passed and "os.fork is not allowed" in result.stderr
    assert code_reward("import subprocess\nsubprocess.run(['true'])\ndef add(a, b):\n    return a + b\n",
                       TESTS, LIMITS) == 0.0


def test_a_network_connection_is_refused():
    code = ("import socket\n"
            "try:\n"
            "    socket.create_connection(('192.0.2.1', 80), timeout=2)\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('refused:', e)\n")
    result = run_python(code, LIMITS)
    assert result.passed and result.stdout.startswith("refused:") and "CONNECTED" not in result.stdout


def test_a_write_outside_the_directory_is_refused_and_inside_is_allowed(tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    code = (f"open('inside.txt', 'w').write('ok')\n"
            f"print(open('inside.txt').read())\n"
            f"open({str(target)!r}, 'w').write('escaped')\n")
    result = run_python(code, LIMITS)
    assert result.stdout.strip() == "ok" and "PermissionError" in result.stderr and not result.passed
    assert not target.exists()


@pytest.mark.skipif(not namespaces_available(), reason="needs unprivileged user namespaces (unshare)")
def test_the_kernel_refuses_a_write_that_bypasses_the_python_guard(tmp_path):
    # ctypes calls open(2) directly, past the audit hook; the read-only mounts must still refuse it.
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    code = ("import ctypes, os\n"
            f"fd = ctypes.CDLL(None, use_errno=True).open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)\n"
            "print(fd, ctypes.get_errno())\n")
    result = run_python(code, LIMITS)
    assert result.isolated and result.stdout.split() == ["-1", "30"], result  # EROFS
    assert not target.exists()


def test_output_beyond_the_limit_is_cut():
    result = run_python("print('x' * 100000)\n", LIMITS)
    assert not result.passed and len(result.stdout) <= LIMITS.output_bytes
