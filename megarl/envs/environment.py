"""The environment interface of multi-turn rollouts, the built-in environments, and the one place that
chooses between them.

An environment is any object with

    tools: list[dict]                                  # JSON schemas of its tools, for the chat template; [] for none
    reset(prompt: str, metadata: dict) -> None         # a new episode for this prompt row
    step(turn: str) -> Step                            # the model's turn (text, special tokens kept)

`Step.observation` is what the model reads next, as tool messages (one per call; rendered in the chat
template's tool-response format by the rollout); `done` ends the episode (the turn was the final answer);
`reward`, when not None, is added to the recipe's reward of the trajectory. One environment object serves
one trajectory at a time, so it may keep per-episode state; steps of different trajectories run
concurrently on different objects, each bounded by `env.tool_timeout_s`. An environment whose step returns
at once (no tool, no I/O) may say so with a class attribute `steps_inline = True`: its steps then run on the
rollout's own thread, unbounded, instead of going through a worker thread (a round trip that costs more
than such a step); the built-in single_turn does.

A recipe chooses one with `env.name`: a built-in below, or `module:Class` for your own, built as
Class(**env.options) once per trajectory. An `env.name` that does not import, or a class that does not
build with its options, stops the launch with a RecipeError naming the key.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from megarl import inject
from megarl.config import EnvConfig, RecipeError, SandboxConfig
from megarl.envs.documents import DocumentIndex
from megarl.envs.tool_format import parse_tool_calls
from megarl.envs.tools import CALCULATOR, Tool, python_tool, search_tool
from megarl.rewards.sandbox import SandboxUnavailable


@dataclass(frozen=True)
class Step:
    observation: list[str] = field(default_factory=list)  # tool messages for the model; unused when done
    done: bool = False  # the episode is over: the turn was the final answer
    reward: float | None = None  # added to the trajectory's reward; None = nothing
    tool_calls: int = 0  # calls made in this step, for the env/tool_calls_mean metric


class Environment(Protocol):
    tools: list[dict]

    def reset(self, prompt: str, metadata: dict) -> None: ...

    def step(self, turn: str) -> Step: ...


class SingleTurn:
    """One model turn and done: the plain RL rollout, scored by the recipe's reward terms alone."""

    tools: list[dict] = []
    steps_inline = True

    def reset(self, prompt: str, metadata: dict) -> None:
        pass

    def step(self, turn: str) -> Step:
        return Step(done=True)


class ToolEnvironment:
    """Tools the model calls from its turns. Each call in a turn runs in order and answers with one tool
    message; a call that cannot be read, names an unknown tool or raises answers with an error message
    instead. A turn without a call is the final answer and ends the episode (the recipe's rewards score it)."""

    def __init__(self, tools: Sequence[Tool], *, tool_format: str):
        self.by_name = {tool.name: tool for tool in tools}
        self.tools = [tool.schema for tool in tools]
        self.tool_format = tool_format

    def reset(self, prompt: str, metadata: dict) -> None:
        pass

    def step(self, turn: str) -> Step:
        calls = parse_tool_calls(turn, tool_format=self.tool_format)
        if not calls:
            return Step(done=True)
        return Step(observation=[self._answer(call) for call in calls], tool_calls=len(calls))

    def _answer(self, call) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        tool = self.by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(self.by_name)}"
        try:
            return tool(call.arguments)
        except Exception as e:  # noqa: BLE001 - a failing call is the model's to see, not the run's to stop
            return f"error: {e}" if isinstance(e, ValueError) else f"error: {type(e).__name__}: {e}"


def environment_factory(cfg: EnvConfig) -> Callable[[], Environment]:
    """A function that builds a fresh environment for one trajectory; RecipeError naming the key when the
    recipe's environment cannot be built (checked here by building one)."""
    match cfg.kind:
        case "single_turn":
            make = SingleTurn
        case "calculator":
            make = partial(ToolEnvironment, [CALCULATOR], tool_format=cfg.tool_format)
        case "python":
            try:
                tool = python_tool(cfg.sandbox or SandboxConfig())
            except SandboxUnavailable as e:
                raise RecipeError(f"env.sandbox: {e}") from None
            make = partial(ToolEnvironment, [tool], tool_format=cfg.tool_format)
        case "retrieval":
            try:
                index = DocumentIndex.load(cfg.documents_path)
            except ValueError as e:
                raise RecipeError(f"env.documents_path: {e}") from None
            make = partial(ToolEnvironment, [search_tool(index, top_k=cfg.top_k or 3)], tool_format=cfg.tool_format)
        case _:
            make = partial(_import_class(cfg.name), **(cfg.options or {}))
    try:
        env = make()
    except Exception as e:  # noqa: BLE001 - user code: any error building it is a recipe error
        raise RecipeError(f"env.options: {cfg.name} cannot be built with {cfg.options or {}}: "
                          f"{type(e).__name__}: {e}") from None
    missing = [name for name in ("tools", "reset", "step") if not hasattr(env, name)]
    if missing:
        raise RecipeError(f"env.name: {cfg.name} has no {', '.join(missing)} (see megarl/envs/environment.py)")
    return inject.environments(make)


def _import_class(spec: str) -> type:
    module_name, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except Exception as e:  # noqa: BLE001 - any import-time error of user code is a recipe error
        raise RecipeError(f"env.name: cannot import {spec!r}: {type(e).__name__}: {e}") from None
