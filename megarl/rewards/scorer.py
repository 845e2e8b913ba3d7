"""The recipe's reward: weighted terms built once, scored per sample in this process or on a Ray pool, and
the failure policy, which lives here only: a sample whose reward raises, runs past `reward.timeout_s` or
is not finite scores 0, is counted, and the first one of a batch is logged. Scoring never ends the run.

    scorer = Scorer(cfg.reward)                       # RecipeError now if a custom function does not import
    rewards, failures = scorer(samples)               # list[float] [B], int
    scoring = scorer.batch(B)                         # or sample by sample, as generation finishes each
    scoring.submit(i, sample)                         # ... for every i; on a pool, scoring starts now
    rewards, failures, scored_before = scoring.result()
    scorer.close()
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from megarl.config import RecipeError, RewardConfig, RewardTermConfig, SandboxConfig
from megarl.rewards.exact import exact_answer_reward
from megarl.rewards.math_answer import math_reward
from megarl.rewards.sandbox import code_reward
from megarl.rewards.shaping import format_reward, length_penalty

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """What a reward sees of one generated sample."""

    prompt: str  # the prompt text, before any chat template
    response: str  # the decoded response
    answer: str  # the prompt row's reference answer
    metadata: dict = field(default_factory=dict)  # the prompt row's metadata
    response_tokens: int = 0  # response length in tokens, EOS included


RewardFn = Callable[[Sample], float]
# (reward, None) for a scored sample; (nan, why) for a failed one, which settle() turns into 0.
Outcome = tuple[float, str | None]


class SampleTimeout(BaseException):
    """Scoring one sample ran past its time limit. A BaseException, so that reward code that catches
    Exception (math-verify does, to return "no answer") cannot swallow it."""


# ---- terms ------------------------------------------------------------------------------------------------
def build_terms(cfg: RewardConfig) -> list[tuple[float, RewardFn]]:
    """(weight, reward function) for every per-sample term of the recipe, checked now so that a missing
    library or a custom function that does not import stops the launch with RecipeError naming the term's
    key. Reward-model terms are not here: the trainer scores them (megarl.loops.rl)."""
    return [(term.weight, term_function(term, key=f"reward.terms[{i}]")) for i, term in enumerate(cfg.terms)
            if term.kind != "reward_model"]


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
            return lambda s: code_reward(s.response, s.answer, limits)
        case "custom":
            fn = import_function(term.function, key=f"{key}.function")
            return lambda s: fn(prompt=s.prompt, response=s.response, answer=s.answer, metadata=s.metadata)
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


def _require(module: str, *, key: str, install: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise RecipeError(f"{key}: this reward needs {install}: pip install {install}") from None


# ---- scoring and the failure policy ---------------------------------------------------------------------
def score_sample(terms: Sequence[tuple[float, RewardFn]], sample: Sample, *, timeout_s: float) -> Outcome:
    """The weighted sum of the terms on one sample, or (nan, why) when a term raises, the sample takes
    longer than `timeout_s` or the sum is not finite."""
    try:
        with time_limit(timeout_s):
            total = sum(weight * float(fn(sample)) for weight, fn in terms)
    except SampleTimeout as e:
        return math.nan, str(e)
    except Exception as e:  # noqa: BLE001 - a reward must never end the run
        return math.nan, f"{type(e).__name__}: {e}"
    if not math.isfinite(total):
        return math.nan, f"reward is {total}"
    return total, None


def score_samples(terms: Sequence[tuple[float, RewardFn]], samples: Sequence[Sample], *,
                  timeout_s: float) -> list[Outcome]:
    """Outcomes of `samples` scored one after another in this process; what each Ray task runs too."""
    return [score_sample(terms, s, timeout_s=timeout_s) for s in samples]


def settle(outcomes: Sequence[Outcome], samples: Sequence[Sample]) -> tuple[list[float], int]:
    """Rewards [B] with every failed sample at 0.0, and the number of failures; logs the first failure."""
    failed = [i for i, (_, why) in enumerate(outcomes) if why is not None]
    if failed:
        i = failed[0]
        log.warning("%d of %d rewards failed and score 0; the first, on response %r: %s", len(failed),
                    len(outcomes), samples[i].response[:200], outcomes[i][1])
    return [0.0 if why is not None else value for value, why in outcomes], len(failed)


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


class Scorer:
    """The recipe's reward over a batch of samples, in this process or, with `reward.workers > 0`, on a pool
    of Ray workers (same outcomes, scored in parallel)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.terms = build_terms(cfg)  # fails at launch, naming the key, rather than on every sample
        if cfg.workers:
            from megarl.rewards.pool import RayPool

            self.pool = RayPool(cfg)
        else:
            self.pool = None

    def batch(self, n: int) -> Scoring:
        """A batch of `n` samples to hand in one by one as their responses are final (see Scoring)."""
        return Scoring(self, n)

    def __call__(self, samples: Sequence[Sample]) -> tuple[list[float], int]:
        scoring = self.batch(len(samples))
        for i, sample in enumerate(samples):
            scoring.submit(i, sample)
        rewards, failures, _ = scoring.result()
        return rewards, failures

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class Scoring:
    """The rewards of one batch of `n` samples, handed in by index, in any order, while the rest are still
    being generated.

    On a pool, samples leave for the workers as soon as a chunk of them is full, so scoring overlaps
    generation; `result()` sends the last partial chunk and waits for the rest. In this process, samples
    are scored when `result()` is called: scoring here would hold up the generation that hands them in.
    Outcomes depend on each sample alone, so the rewards are the same whatever the order of arrival.

        scoring = scorer.batch(n)
        scoring.submit(i, sample)                         # for every i in range(n), as sample i is final
        rewards, failures, scored_before = scoring.result()
    """

    def __init__(self, scorer: Scorer, n: int):
        self.scorer = scorer
        self.samples: list[Sample | None] = [None] * n
        self.chunk_size = scorer.pool.chunk_size(n) if scorer.pool is not None else n
        self.waiting: list[int] = []  # indices handed in and not sent yet
        self.sent: list[tuple[list[int], object]] = []  # (indices, task reference) of each chunk on the pool

    def submit(self, i: int, sample: Sample) -> None:
        if self.samples[i] is not None:
            raise ValueError(f"sample {i} of the batch was handed in twice")
        self.samples[i] = sample
        self.waiting.append(i)
        if self.scorer.pool is not None and len(self.waiting) == self.chunk_size:
            self.send()

    def send(self) -> None:
        self.sent.append((self.waiting, self.scorer.pool.submit([self.samples[i] for i in self.waiting])))
        self.waiting = []

    def result(self) -> tuple[list[float], int, int]:
        """Rewards [n] (failed samples at 0), the number that failed, and the number whose outcome was
        already back when this was called (0 in this process): how much of scoring was hidden."""
        missing = [i for i, sample in enumerate(self.samples) if sample is None]
        if missing:
            raise ValueError(f"{len(missing)} of {len(self.samples)} samples were never handed in, "
                             f"the first is {missing[0]}")
        samples: list[Sample] = self.samples
        pool = self.scorer.pool
        if pool is None or not samples:
            return *settle(score_samples(self.scorer.terms, samples, timeout_s=self.scorer.cfg.timeout_s),
                           samples), 0
        if self.waiting:
            self.send()
        chunks, scored_before = pool.collect([ref for _, ref in self.sent], [len(ix) for ix, _ in self.sent])
        outcomes: list[Outcome] = [(math.nan, "")] * len(samples)
        for (indices, _), chunk in zip(self.sent, chunks):
            for i, outcome in zip(indices, chunk):
                outcomes[i] = outcome
        return *settle(outcomes, samples), scored_before
