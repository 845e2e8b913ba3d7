"""Environments the multi-turn tests load by import path (`env.name: envs_for_tests:Class`), as a recipe would."""

from __future__ import annotations

import dataclasses
import threading
import time

from megarl.envs.environment import Step


class CountingEnv:
    """Answers every turn with one tool message "obs <turn>" and is never done: only limits end an episode.
    Records what it was shown, so a test can rebuild the trajectory independently."""

    tools: list[dict] = []

    def __init__(self, reward_per_step: float | None = None):
        self.reward_per_step = reward_per_step
        self.turns: list[str] = []
        self.observations: list[str] = []

    def reset(self, prompt: str, metadata: dict) -> None:
        self.turns, self.observations = [], []

    def step(self, turn: str) -> Step:
        self.turns.append(turn)
        self.observations.append(f"obs {len(self.turns)}")
        return Step(observation=[self.observations[-1]], reward=self.reward_per_step, tool_calls=1)


class SleepyEnv:
    """Each step sleeps the row's metadata["sleep_s"] seconds, then answers; done on the second turn.
    A metadata["raise"] makes the step raise instead."""

    tools: list[dict] = []

    def reset(self, prompt: str, metadata: dict) -> None:
        self.sleep_s, self.fail, self.turn = metadata.get("sleep_s", 0.0), metadata.get("raise"), 0

    def step(self, turn: str) -> Step:
        self.turn += 1
        if self.fail:
            raise RuntimeError(self.fail)
        time.sleep(self.sleep_s)
        return Step(observation=["ok"], done=self.turn >= 2, tool_calls=1)


class InlineEnv(SleepyEnv):
    """SleepyEnv without the sleep, declaring that its steps return at once (`steps_inline`); each step
    records the thread it ran on."""

    steps_inline = True
    threads: list[int] = []

    def step(self, turn: str) -> Step:
        InlineEnv.threads.append(threading.get_ident())
        return super().step(turn)


class NeedsOption:
    """Built only with a `level` keyword: for the launch-time check of env.options."""

    tools: list[dict] = []

    def __init__(self, *, level: int):
        self.level = level

    def reset(self, prompt: str, metadata: dict) -> None:
        pass

    def step(self, turn: str) -> Step:
        return Step(done=True)


class StepRewardEnv:
    """Done on the first turn, with the row's metadata["step_reward"] (anything, or None) as its step reward."""

    tools: list[dict] = []

    def reset(self, prompt: str, metadata: dict) -> None:
        self.reward = metadata.get("step_reward")

    def step(self, turn: str) -> Step:
        return Step(done=True, reward=self.reward)


class FlakyEnv(CountingEnv):
    """CountingEnv whose environments, numbered as they are made, raise at the turn the row's metadata gives
    for each ({"raise_at": {"0": 2}}: environment 0 raises at its turn 2; a turn replayed counts too). With
    metadata["shuffled"] each environment answers in its own words ("obs N from env K"), so a fresh one
    cannot stand in for an earlier one. `made` counts the environments made since `made` was cleared."""

    made = [0]

    def __init__(self, reward_per_step: float | None = None):
        super().__init__(reward_per_step)
        self.index = FlakyEnv.made[0]
        FlakyEnv.made[0] += 1

    def reset(self, prompt: str, metadata: dict) -> None:
        super().reset(prompt, metadata)
        self.raise_at = metadata.get("raise_at", {}).get(str(self.index))
        self.shuffled = metadata.get("shuffled", False)

    def step(self, turn: str) -> Step:
        if len(self.turns) + 1 == self.raise_at:
            raise RuntimeError(f"environment {self.index} fails at turn {self.raise_at}")
        step = super().step(turn)
        if self.shuffled:
            return dataclasses.replace(step, observation=[f"{step.observation[0]} from env {self.index}"])
        return step
