"""Reward terms and how one sample is scored: what a reward sees (`Sample`), the recipe's terms built once
(`build_terms`), and one sample's weighted sum under a time limit, a failure returned as (nan, why).

Shared by the trainer's scorer (megarl.rewards.scorer) and the Ray workers (megarl.rewards.pool), which run
the same `score_samples`.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from megarl import inject
from megarl.config import RecipeError, RewardConfig, RewardTermConfig, SandboxConfig
from megarl.rewards.exact import exact_answer_reward
from megarl.rewards.judge import Judge
from megarl.rewards.math_answer import math_reward
from megarl.rewards.code import code_reward
from megarl.rewards.sandbox import SandboxUnavailable, check_sandbox, run_python
from megarl.rewards.shaping import format_reward, length_penalty


@dataclass(frozen=True)
class Sample:
    """What a reward sees of one generated sample."""

    prompt: str  # the prompt text, before any chat template
    response: str  # the decoded response
    answer: str  # the prompt row's reference answer
    metadata: dict = field(default_factory=dict)  # the prompt row's metadata
    response_tokens: int = 0  # response length in tokens, EOS included
    fault_mark: str | None = None  # a fault injected in scoring it (megarl.inject.reward_mark); tests only


RewardFn = Callable[[Sample], float]
# (weight, function, the recipe key that names the term in failure messages, e.g. "reward.terms[1] (custom)")
Term = tuple[float, RewardFn, str]
# (reward, None) for a scored sample; (nan, why) for a failed one, which settle() turns into 0.
Outcome = tuple[float, str | None]


class SampleTimeout(BaseException):
    """Scoring one sample ran past its time limit. A BaseException, so that reward code that catches
    Exception (math-verify does, to return "no answer") cannot swallow it."""


# ---- terms ------------------------------------------------------------------------------------------------
def build_terms(cfg: RewardConfig) -> list[Term]:
    """(weight, reward function, key) for every per-sample term of the recipe, checked now so that a missing
    library or a custom function that does not import stops the launch with RecipeError naming the term's
    key. Reward-model terms are not here: the trainer scores them (megarl.loops.rl)."""
    return [(term.weight, term_function(term, key=f"reward.terms[{i}]"), _term_name(term, i))
            for i, term in enumerate(cfg.terms) if term.kind != "reward_model"]


def _term_name(term: RewardTermConfig, i: int) -> str:
    return f"reward.terms[{i}] ({term.function if term.kind == 'custom' else term.kind})"


def term_function(term: RewardTermConfig, *, key: str) -> RewardFn:
    match term.kind:
        case "exact_answer":
            return lambda s: exact_answer_reward(s.response, s.answer)
        case "math":
            _require("math_verify", key=f"{key}.kind", install="math-verify")
            return lambda s: math_reward(s.response, s.answer)
        case "format":
            pattern = re.compile(term.pattern, re.DOTALL)
            return lambda s: format_reward(s.response, pattern)
        case "length_penalty":
            max_tokens, cache_tokens = term.max_tokens, term.cache_tokens
            return lambda s: length_penalty(s.response_tokens, max_tokens=max_tokens, cache_tokens=cache_tokens)
        case "code":
            limits = term.sandbox or SandboxConfig()
            require_sandbox(limits, key=f"{key}.sandbox")
            return lambda s: code_reward(s.response, s.answer, limits)
        case "custom":
            fn = import_function(term.function, key=f"{key}.function")
            return lambda s: fn(prompt=s.prompt, response=s.response, answer=s.answer, metadata=s.metadata)
        case "judge":
            return Judge(term.judge, key=key)
    raise RecipeError(f"{key}.kind: unknown reward kind {term.kind!r}")


def import_function(spec: str, *, key: str) -> Callable:
    """The callable named by `module:function`; RecipeError naming `key` when it cannot be imported."""
    module_name, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except Exception as e:  # noqa: BLE001 - any import-time error of user code is a recipe error
        raise RecipeError(f"{key}: cannot import {spec!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise RecipeError(f"{key}: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def require_sandbox(limits: SandboxConfig, *, key: str) -> None:
    """RecipeError naming `key` when generated code could not run isolated here (see megarl.rewards.sandbox)."""
    try:
        check_sandbox(limits)
    except SandboxUnavailable as e:
        raise RecipeError(f"{key}: {e}") from None


def _require(module: str, *, key: str, install: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise RecipeError(f"{key}: this reward needs {install}: pip install {install}") from None


# ---- scoring and the failure policy ---------------------------------------------------------------------
FLOAT32_MAX = 3.4028234663852886e38


def score_sample(terms: Sequence[Term], sample: Sample, *, timeout_s: float) -> Outcome:
    """The weighted sum of the terms on one sample, or (nan, why) when a term raises or returns something
    that is not a finite real number (a string such as "1.0" included; a bool counts as 0 or 1), the sample
    takes longer than `timeout_s` or the sum is beyond float32's range. `why` starts with the failing term's key."""
    total, name = 0.0, ""
    try:
        with time_limit(timeout_s):
            if sample.fault_mark is not None:
                name = "reward (injected fault)"
                inject.score_marked(sample.fault_mark, run_sandboxed=run_python)
            for weight, fn, name in terms:
                value = fn(sample)
                if not isinstance(value, numbers.Real):
                    return math.nan, f"{name}: returned {value!r:.80} ({type(value).__name__}), not a number"
                if not math.isfinite(value):
                    return math.nan, f"{name}: returned {float(value)}, not a finite number"
                total += weight * float(value)
    except SampleTimeout as e:
        return math.nan, f"{name}: {e}"
    except Exception as e:  # noqa: BLE001 - a reward must never end the run
        return math.nan, f"{name}: {type(e).__name__}: {e}"
    if not abs(total) <= FLOAT32_MAX:  # the batch holds rewards in float32, where a larger one is inf
        return math.nan, f"reward is {total:g}, beyond float32's range (the rewards are float32 in the batch)"
    return total, None


def score_samples(terms: Sequence[Term], samples: Sequence[Sample], *,
                  timeout_s: float) -> list[Outcome]:
    """Outcomes of `samples` scored one after another in this process; what each Ray task runs too. A judge
    term first grades the whole batch, its requests in flight together (megarl.rewards.judge)."""
    for _, fn, _ in terms:
        if isinstance(fn, Judge):
            fn.prefetch(samples)
    return [score_sample(terms, s, timeout_s=timeout_s) for s in samples]


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise SampleTimeout in the body after `seconds` of wall time (SIGALRM).

    Signals reach only the main thread, so elsewhere the body runs unbounded; the trainer scores on its
    main thread and Ray runs tasks on its workers' main threads. A timer already running (pytest-timeout's,
    say) is suspended meanwhile and re-armed with its remaining time afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise SampleTimeout(f"scoring took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer_s, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_s:
            signal.setitimer(signal.ITIMER_REAL, max(outer_s - (time.monotonic() - start), 1e-3))
