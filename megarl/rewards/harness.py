"""The code reward's harness: the program that runs a candidate's code in the sandbox and reports what it
produced, as digests, to the trusted side (megarl.rewards.code), which alone knows the expected results.

Standard library only: this file's source is the program the sandbox runs. It reads one JSON job from stdin,
{"solution": source, "stdin_cases": [str, ...]} or {"solution": source, "calls": ["f(1, 2)", ...]}, and
writes one line per case to the stdout it was started with: `INDEX DIGEST` or `INDEX error NAME`.
- stdin cases: the solution runs as its own program per case, fed the case, its output kept in a file;
  the digest is of its output normalized by `normalize_output`, when the program exited with status 0
  (else the case is `error exit_status`, which matches nothing).
- calls: the solution is executed once, then each call's literal arguments are passed to the named
  function; the digest is of `encode(result)`, which spells exact types, so a subclass or an object with
  a forged __eq__ encodes as "unsupported" and matches nothing.
The candidate's own prints go to /dev/null in call mode. Whatever the candidate does here, it never sees an
expected result, so it can only score by producing it.
"""

import ast
import hashlib
import json
import os
import subprocess
import sys


def normalize_output(text: str) -> str:
    """Output as judges compare it: trailing whitespace of each line and trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def encode(value) -> list:
    """A JSON tree naming the exact type of every part of `value` (literals only: None, bool, int, float,
    complex, str, bytes, list, tuple, dict, set, frozenset); sets and dicts in a canonical order."""
    kind = type(value)
    if value is None or kind in (bool, str):
        return [kind.__name__, value]
    if kind in (int, float, complex):
        return [kind.__name__, repr(value)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple):
        return [kind.__name__, [encode(item) for item in value]]
    if kind in (set, frozenset):
        return [kind.__name__, sorted(json.dumps(encode(item)) for item in value)]
    if kind is dict:
        return ["dict", sorted([json.dumps(encode(k)), encode(v)] for k, v in value.items())]
    return ["unsupported", f"{kind.__module__}.{kind.__qualname__}"]


def digest(data: str) -> str:
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()


def parse_call(call: str) -> tuple[str, tuple, dict]:
    """("f", args, kwargs) of a call written `f(1, "a", k=[2])` with literal arguments; ValueError otherwise."""
    node = ast.parse(call.strip(), mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and all(k.arg is not None for k in node.keywords)):
        raise ValueError(f"expected a call of a named function with literal arguments, got {call!r}")
    return (node.func.id, tuple(ast.literal_eval(a) for a in node.args),
            {k.arg: ast.literal_eval(k.value) for k in node.keywords})


def _run_stdin_cases(solution: str, cases: list, report) -> None:
    with open("solution.py", "w", encoding="utf-8") as f:
        f.write(solution)
    for i, case in enumerate(cases):
        with open(f"out{i}", "wb") as out:
            run = subprocess.run([sys.executable, "-I", "solution.py"], input=case.encode(), stdout=out,
                                 stderr=subprocess.DEVNULL, check=False)
        if run.returncode != 0:  # a program that failed, whatever it printed (an empty output included)
            report(i, "error exit_status")
            continue
        with open(f"out{i}", "rb") as f:
            report(i, digest(normalize_output(f.read().decode("utf-8", "replace"))))


def _run_calls(solution: str, calls: list, report) -> None:
    namespace = {"__name__": "solution"}
    exec(compile(solution, "solution.py", "exec"), namespace)
    for i, call in enumerate(calls):
        name, args, kwargs = parse_call(call)
        try:
            report(i, digest(json.dumps(encode(namespace[name](*args, **kwargs)))))
        except BaseException as e:  # noqa: BLE001 - SystemExit from the candidate is a failed case too
            report(i, f"error {type(e).__name__}")


def main() -> None:
    job = json.loads(sys.stdin.read())
    results = os.dup(1)  # the candidate's prints must not mix with the results: they go to /dev/null
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)

    def report(i: int, outcome: str) -> None:
        os.write(results, f"{i} {outcome}\n".encode())

    if "stdin_cases" in job:
        _run_stdin_cases(job["solution"], job["stdin_cases"], report)
    else:
        _run_calls(job["solution"], job["calls"], report)


if __name__ == "__main__":
    main()
