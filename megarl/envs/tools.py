"""The built-in tools: each a function of the call's arguments returning the text the model reads back,
with the JSON schema a chat template lists in the prompt.

    calculator  {"expression": "47*86"}     -> "4042"
    python      {"code": "print(2**10)"}    -> "1024\n"   (run in the sandbox of megarl.rewards.sandbox)
    search      {"query": "river Osk"}      -> the best-matching documents (megarl.envs.documents)

The calculator evaluates arithmetic itself, without running code: it walks the expression's syntax tree
and accepts only numbers, + - * / // % ** and parentheses, so nothing but arithmetic can run; that takes
microseconds, where starting a sandboxed interpreter takes tens of milliseconds per call. The python tool
is the one that runs code, and it always does so in the sandbox.

A tool raises ToolError (or any exception) for a call it cannot answer; the environment turns that into
an error message for the model.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass

from megarl.config import SandboxConfig
from megarl.rewards.sandbox import check_sandbox, run_python


class ToolError(ValueError):
    """A call the tool cannot answer; its message is shown to the model."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[[dict], str]

    @property
    def schema(self) -> dict:
        """The tool as chat templates take it (`apply_chat_template(tools=[...])`, OpenAI function format)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, arguments: dict) -> str:
        return self.fn(arguments)


def _string_argument(arguments: dict, key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ToolError(f'expected a string argument "{key}", got {sorted(arguments) or "no arguments"}')
    return value


# ---- calculator -----------------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 100  # bounds ** so a call cannot build a number that takes seconds to print


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError for anything else or a result too large."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None

    def value(node) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(left) > 1 and \
                    abs(right) * len(str(int(abs(left)))) > MAX_RESULT_DIGITS:
                raise ToolError(f"result would have more than {MAX_RESULT_DIGITS} digits")
            try:
                return _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
        raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed: {expression!r}")

    return value(tree.body)


def _calculator(arguments: dict) -> str:
    result = evaluate_arithmetic(_string_argument(arguments, "expression"))
    if isinstance(result, float):
        return str(int(result)) if result.is_integer() and abs(result) < 1e15 else f"{result:.12g}"
    return str(result)


CALCULATOR = Tool("calculator", "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                  _calculator)


# ---- python ---------------------------------------------------------------------------------------------
def python_tool(limits: SandboxConfig) -> Tool:
    """Run Python code in the sandbox; the model reads its standard output (and the end of its standard
    error when it fails). SandboxUnavailable now, not at the first call, when code cannot run isolated here."""
    check_sandbox(limits)

    def run(arguments: dict) -> str:
        result = run_python(_string_argument(arguments, "code"), limits)
        if result.returncode is None:
            return f"{result.stdout}error: killed after {limits.wall_s} s of wall time"
        if result.returncode != 0:
            return f"{result.stdout}error (exit status {result.returncode}):\n{result.stderr[-1000:]}"
        return result.stdout

    return Tool("python", "Run a Python program and return what it prints.",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, run)


# ---- search ---------------------------------------------------------------------------------------------
def search_tool(index, *, top_k: int) -> Tool:
    """Search a local document set (megarl.envs.documents.DocumentIndex); `top_k` documents per query."""

    def run(arguments: dict) -> str:
        hits = index.search(_string_argument(arguments, "query"), top_k=top_k)
        return "\n".join(f"[{doc.title}] {doc.text}" for doc in hits) or "no document matches the query"

    return Tool("search", "Search the document collection; returns the best-matching documents.",
                {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}, run)
