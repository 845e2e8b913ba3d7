"""The `code` reward: a response's code scored against the row's tests, the tests kept outside the sandbox.

The row's answer is a JSON object, one of
    {"stdin_stdout": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]}      a program: output compared per case
    {"calls": [{"call": "add(1, 2)", "expected": "3"}, ...]}         a function: literal args, literal result
Only the inputs (stdin, calls) enter the sandbox, where megarl.rewards.harness runs the code and reports a
digest per case; this process compares them with the digests of the expected outputs (normalized as
harness.normalize_output) or expected values (encoded with exact types by harness.encode: 1 != 1.0 != True,
(1,) != [1]). The reward is 1.0 when the report has exactly one matching line for every case and nothing
else, else 0.0. An exit status, an exception hook, atexit, os._exit or SystemExit, or an object whose __eq__
always says yes scores nothing: none of them produces the expected digest.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from megarl.config import SandboxConfig
from megarl.data.prompts import DataError, PromptRow
from megarl.rewards import harness
from megarl.rewards.sandbox import run_python

HARNESS_SOURCE = Path(harness.__file__).read_text(encoding="utf-8")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_LINE = re.compile(r"(0|[1-9]\d{0,8}) ([0-9a-f]{64}|error \w+)")  # an index int() always reads


class CodeSpecError(ValueError):
    """A row's answer that is not a test specification of the code reward."""


def extract_code(response: str) -> str:
    """The last fenced code block of the response (```python ... ``` or ``` ... ```), else the response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(answer: str) -> tuple[dict, list[str]]:
    """(the job's inputs for the harness, the expected digest of each case) of a row's answer;
    CodeSpecError saying what is wrong, old-style assert text included."""
    try:
        spec = json.loads(answer)
    except (ValueError, TypeError):  # not JSON, or not a string at all
        spec = None
    except RecursionError:
        raise CodeSpecError(f"the answer is nested too deeply to parse: {str(answer)[:80]!r}") from None
    if not isinstance(spec, dict) or len(spec) != 1 or not ({"stdin_stdout", "calls"} & set(spec)):
        raise CodeSpecError('the code reward needs the answer to be a JSON object {"stdin_stdout": [{"stdin", '
                            '"stdout"}, ...]} or {"calls": [{"call", "expected"}, ...]} (assert statements '
                            f"are no longer run), got {str(answer)[:80]!r}")
    cases = next(iter(spec.values()))
    if not isinstance(cases, list) or not cases:
        raise CodeSpecError(f"expected a non-empty list of cases, got {cases!r:.80}")
    try:
        if "stdin_stdout" in spec:
            job = {"stdin_cases": [_string(c, "stdin") for c in cases]}
            expected = [harness.normalize_output(_string(c, "stdout")) for c in cases]
        else:
            job = {"calls": [_string(c, "call") for c in cases]}
            for call in job["calls"]:
                harness.parse_call(call)
            expected = [json.dumps(harness.encode(ast.literal_eval(_string(c, "expected")))) for c in cases]
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as e:
        # literal_eval of a set or dict key that is unhashable, or of nesting deeper than Python parses
        raise CodeSpecError(f"bad test case: {type(e).__name__}: {e}"[:300]) from None
    return job, [harness.digest(e) for e in expected]


def check_test_specs(rows: list[PromptRow], *, where: str, output_bytes: int) -> None:
    """DataError naming the file and row (1-based, among the rows loaded) of the first answer that is not
    a test spec, or whose report (a line per case) would not fit in `output_bytes` (the sandbox's output
    cap), so that it could never score: a prompt set for the code reward is checked at launch, not one
    sample at a time."""
    for row in rows:
        try:
            _, expected = parse_tests(row.answer)
        except CodeSpecError as e:
            raise DataError(f"{where}: row {row.index + 1}: {e}") from None
        if report_bytes(len(expected)) > output_bytes:
            raise DataError(f"{where}: row {row.index + 1}: {len(expected)} cases make a report of "
                            f"{report_bytes(len(expected))} bytes, more than the sandbox's output_bytes "
                            f"({output_bytes}): split the row or raise sandbox.output_bytes")


def report_bytes(n_cases: int) -> int:
    """The size of the harness's report of `n_cases` digests: `INDEX DIGEST\\n` per case."""
    return sum(len(str(i)) + 1 + 64 + 1 for i in range(n_cases))


def _string(case: object, key: str) -> str:
    if not isinstance(case, dict) or not isinstance(case.get(key), str):
        raise CodeSpecError(f'expected a case with a string "{key}", got {case!r:.80}')
    return case[key]


def code_reward(response: str, answer: str, limits: SandboxConfig) -> float:
    """1.0 when the response's code passes every case of the row's tests (`answer`, see the module
    docstring) in one sandboxed run, else 0.0; CodeSpecError for an answer that is not a test spec."""
    job, expected = parse_tests(answer)
    result = run_python(HARNESS_SOURCE, limits, stdin=json.dumps({"solution": extract_code(response), **job}))
    return 1.0 if reported_digests(result.stdout, len(expected)) == expected else 0.0


def reported_digests(report: str, n_cases: int) -> list[str] | None:
    """The digest per case of the harness's report, or None unless it is exactly one well-formed line per
    case (so that code writing guesses of its own to the report scores nothing)."""
    found = {}
    for line in report.splitlines():
        match = _LINE.fullmatch(line)
        if match is None or int(match[1]) in found or int(match[1]) >= n_cases:
            return None
        found[int(match[1])] = match[2]
    return [found[i] for i in range(n_cases)] if len(found) == n_cases else None
