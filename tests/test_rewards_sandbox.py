"""The code sandbox and the code reward: programs run and are limited, test specs score right code 1 and
wrong code 0, a bad spec names its row, a machine without isolation stops the launch (unless `insecure`), and
the external-service hook runs the same harness. Attacks are in tests/test_sandbox_attacks.py."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from megarl.config import EnvConfig, RecipeError, RewardConfig, RewardTermConfig, SandboxConfig
from megarl.data.prompts import DataError, PromptRow
from megarl.envs.environment import environment_factory
from megarl.rewards import harness, sandbox, sandbox_kernel
from megarl.rewards.code import CodeSpecError, check_test_specs, code_reward, extract_code, parse_tests
from megarl.rewards.sandbox import SandboxUnavailable, run_python, sandbox_mode
from megarl.rewards.terms import build_terms

LIMITS = SandboxConfig(cpu_s=2, wall_s=10.0, memory_mb=256, output_bytes=4096)
CALLS = json.dumps({"calls": [{"call": "add(2, 3)", "expected": "5"}, {"call": "add(-1, b=1)", "expected": "0"},
                              {"call": "pair('a')", "expected": "('a', 'a')"}]})
STDIO = json.dumps({"stdin_stdout": [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -4", "stdout": "6"}]})
ADD = "def add(a, b):\n    return a + b\ndef pair(x):\n    return (x, x)\n"


pytestmark = pytest.mark.usefixtures("isolated")  # skipped without isolation, failed in CI (conftest.py)


def test_right_code_scores_1_and_wrong_code_0_for_calls():
    assert code_reward(f"Here you go:\n```python\n{ADD}```\n", CALLS, LIMITS) == 1.0
    assert code_reward(ADD.replace("a + b", "a - b"), CALLS, LIMITS) == 0.0
    assert code_reward(ADD.replace("(x, x)", "[x, x]"), CALLS, LIMITS) == 0.0  # a list is not the tuple expected
    assert code_reward("def add(a, b) return", CALLS, LIMITS) == 0.0  # a syntax error


def test_right_program_scores_1_and_wrong_program_0_for_stdin_stdout():
    program = "a, b = map(int, input().split())\nprint(a + b, '  ')\n"  # trailing spaces do not count
    assert code_reward(program, STDIO, LIMITS) == 1.0
    assert code_reward(program.replace("a + b", "a * b"), STDIO, LIMITS) == 0.0
    assert code_reward("", STDIO, LIMITS) == 0.0


def test_extract_code_takes_the_last_fence_else_the_whole_response():
    assert extract_code("```py\nx = 1\n```\ntext\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"


def test_results_are_encoded_with_exact_types_and_canonical_order():
    assert harness.encode({"b": 1, "a": {2, 1}}) == harness.encode({"a": {1, 2}, "b": 1})
    kinds = [1, 1.0, True, "1", b"1", (1,), [1], frozenset([1]), {1}, None]
    assert len({json.dumps(harness.encode(v)) for v in kinds}) == len(kinds)
    assert harness.encode(type("MyInt", (int,), {})(1))[0] == "unsupported"
    assert harness.normalize_output("5  \n\n7\t\n\n") == "5\n\n7"


@pytest.mark.parametrize("answer, why", [
    ("assert add(2, 3) == 5\n", "assert statements are no longer run"),
    ('{"calls": []}', "non-empty list of cases"),
    ('{"calls": [{"call": "add(x)", "expected": "1"}]}', "bad test case"),
    ('{"calls": [{"call": "add(1)", "expected": "len"}]}', "bad test case"),
    ('{"stdin_stdout": [{"stdin": "1"}]}', 'a string "stdout"'),
    ('{"calls": [{"call": "f()", "expected": "{[1]: 2}"}]}', "bad test case: TypeError"),  # unhashable key
    ('{"calls": [{"call": "f()", "expected": "{[1]}"}]}', "bad test case: TypeError"),  # unhashable member
    ('{"calls": [{"call": "f()", "expected": "' + "[" * 100000 + "]" * 100000 + '"}]}', "bad test case"),
    ('{"calls": [{"call": "f(' + "(" * 100000 + ")" * 100000 + ')", "expected": "1"}]}', "bad test case"),
    ('{"calls": ' + "[" * 100000 + "]" * 100000 + "}", "nested too deeply"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_a_bad_test_spec_is_refused_naming_the_problem_and_the_row(answer, why):
    with pytest.raises(CodeSpecError, match=why):
        parse_tests(answer)
    rows = [PromptRow("p", CALLS, 0), PromptRow("p", answer, 1)]
    with pytest.raises(DataError, match=f"train.jsonl: row 2: .*{why}"):
        check_test_specs(rows, where="train.jsonl", output_bytes=4096)


def test_a_row_whose_report_cannot_fit_the_output_cap_is_refused():
    cases = json.dumps({"calls": [{"call": f"add({i}, 0)", "expected": str(i)} for i in range(100)]})
    check_test_specs([PromptRow("p", cases, 0)], where="train.jsonl", output_bytes=6790)  # 100 lines: 6790 bytes
    with pytest.raises(DataError, match=r"train.jsonl: row 1: 100 cases make a report of 6790 bytes, more than "
                                        r"the sandbox's output_bytes \(6789\)"):
        check_test_specs([PromptRow("p", cases, 0)], where="train.jsonl", output_bytes=6789)
    # a row at the cap scores (the launch check is exact but for the report's last newline, which may be cut)
    assert code_reward("def add(a, b):\n    return a + b\n", cases, replace(LIMITS, output_bytes=6790)) == 1.0


def test_a_run_reads_stdin_and_returns_its_output_and_status():
    result = run_python("import sys\ndata = sys.stdin.read()\nprint(data.upper())\nsys.exit(3)", LIMITS, stdin="hi")
    assert (result.returncode, result.stdout, result.mode) == (3, "HI\n", sandbox_mode())


def test_the_cpu_limit_stops_an_infinite_loop():
    # a wall-clock limit far above it: on a busy machine one CPU-second takes many seconds of wall time
    result = run_python("while True:\n    pass\n", replace(LIMITS, cpu_s=1, wall_s=120.0))
    assert result.returncode == 128 + 24, result  # SIGXCPU


def test_the_wall_clock_limit_stops_a_sleeping_program():
    assert run_python("import time\ntime.sleep(60)\n", replace(LIMITS, wall_s=1.0)).returncode is None


def test_output_beyond_the_limit_is_cut():
    result = run_python("print('x' * 1000000)\n", LIMITS)  # more than the pipe and one read hold
    assert len(result.stdout) <= LIMITS.output_bytes and not result.passed


# ---- failing closed -------------------------------------------------------------------------------------------
@pytest.fixture
def no_bwrap(monkeypatch):
    """A machine without bubblewrap: PATH without it, the probe forgotten before and after."""
    sandbox.sandbox_mode.cache_clear()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    yield
    monkeypatch.undo()
    sandbox.sandbox_mode.cache_clear()


def test_without_bwrap_a_code_reward_or_python_tool_stops_the_launch(no_bwrap):
    with pytest.raises(RecipeError, match=r"reward.terms\[0\].sandbox: .*apt-get install bubblewrap"):
        build_terms(RewardConfig(terms=[RewardTermConfig(kind="code")]))
    with pytest.raises(RecipeError, match="env.sandbox: .*bubblewrap"):
        environment_factory(EnvConfig(name="python"))


@pytest.mark.skipif(os.getuid() != 0, reason="simulates a root trainer whose sandbox keeps host uid 0")
def test_a_sandbox_running_as_host_root_stops_the_launch(monkeypatch):
    # megarl switches bwrap to nobody only for a root trainer: told it is not root, it would not
    sandbox.sandbox_mode.cache_clear()
    sandbox._interpreter.cache_clear()
    monkeypatch.setattr(sandbox.os, "getuid", lambda: 1000)
    try:
        with pytest.raises(SandboxUnavailable, match=r"cgroup mode: .*host root \(uid 0\).*rlimit mode: .*host root"):
            sandbox.sandbox_mode()
    finally:
        monkeypatch.undo()
        sandbox.sandbox_mode.cache_clear()
        sandbox._interpreter.cache_clear()


@pytest.mark.skipif(os.getuid() != 0, reason="a root trainer's runs: needs root")
def test_runs_of_a_root_trainer_held_at_once_have_uids_of_their_own():
    with sandbox_kernel.run_user(LIMITS) as first, sandbox_kernel.run_user(LIMITS) as second:
        assert first != second and first in sandbox_kernel.RUN_UIDS and second in sandbox_kernel.RUN_UIDS
        held = sorted(os.listdir(sandbox_kernel.lock_dir()))
        assert str(first) in held and str(second) in held
    assert str(first) not in os.listdir(sandbox_kernel.lock_dir())  # released: the lock file is gone


@pytest.mark.parametrize("share_uid", [False, True])
def test_runs_of_a_trainer_that_is_not_root_are_one_at_a_time_unless_they_share_the_uid(monkeypatch, share_uid):
    monkeypatch.setattr(sandbox_kernel.os, "getuid", lambda: 1000)
    limits, inside, most = replace(LIMITS, share_uid=share_uid), [], []
    lock = threading.Lock()

    def hold() -> None:
        with sandbox_kernel.run_user(limits) as user:
            assert user is None  # the trainer's own uid
            with lock:
                inside.append(1)
                most.append(len(inside))
            threading.Event().wait(0.3)
            with lock:
                inside.pop()

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(most) == (3 if share_uid else 1), most


def test_insecure_runs_without_isolation_and_says_so(no_bwrap, caplog):
    limits = replace(LIMITS, insecure=True)
    sandbox._warn_insecure.cache_clear()  # warned once per process
    build_terms(RewardConfig(terms=[RewardTermConfig(kind="code", sandbox=limits)]))
    assert code_reward(ADD, CALLS, limits) == 1.0 and code_reward("", CALLS, limits) == 0.0
    assert run_python("print(1)", limits).mode == "insecure"
    assert "WITHOUT isolation" in caplog.text


# ---- the external service ---------------------------------------------------------------------------------------
@pytest.fixture
def service():
    """A local sandbox service: runs each posted program in this machine's sandbox, as a real one would."""
    posted = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            job = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posted.append(job)
            if job["code"] == "bad answer":
                body = b'{"returncode": "zero"}'
            else:
                result = run_python(job["code"], SandboxConfig(**job["limits"]), stdin=job["stdin"])
                body = json.dumps({"returncode": result.returncode, "stdout": result.stdout,
                                   "stderr": result.stderr}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/run", posted
    server.shutdown()
    thread.join(timeout=10)


def test_the_code_reward_runs_on_an_external_service(service):
    url, posted = service
    limits = replace(LIMITS, service_url=url)
    assert code_reward(ADD, CALLS, limits) == 1.0 and code_reward("def add(a, b): return 0", CALLS, limits) == 0.0
    # the service gets the harness and the inputs, never an expected result
    assert len(posted) == 2 and "('a', 'a')" not in json.dumps(posted) and posted[0]["limits"]["memory_mb"] == 256
    assert run_python("print(7)", limits).stdout == "7\n"
    with pytest.raises(sandbox.SandboxServiceError, match="expected"):
        run_python("bad answer", limits)
