"""The `judge` reward term: a generative model grades each response, asked over an OpenAI-compatible HTTP API.

    reward:
      terms:
        - kind: judge
          judge: {url: "http://localhost:30000/v1", api: chat, max_concurrency: 8, timeout_s: 60}

Each sample's request is `judge.template` filled with the question (the prompt text), the response and the
reference answer (the row's answer, "" without one), sent as one user message to `/chat/completions` or as
the prompt of `/completions`. The reply's text is searched with `judge.score_pattern`; the last match's
group `score` is the score, which must lie in [min_score, max_score], and the reward is the score mapped
linearly onto [0, 1].

The scorer hands the judge a whole batch before it scores the batch's samples one by one (`Judge.prefetch`,
from megarl.rewards.terms.score_samples): every request of the batch is sent from a pool of at most
`max_concurrency` threads, so at most that many are in flight from one scoring process (the trainer, or each
Ray worker with `reward.workers`), and each waits at most `timeout_s` to connect and for every read of its
reply. An HTTP error, a timeout, a reply that is not the API's JSON, or one without a score in range is a
JudgeError, raised when its sample is scored: the sample fails under the scorer's policy (it scores 0, is
counted, and the first failure of a batch is logged with the term's key).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from megarl.config import JudgeConfig, RecipeError

REPLY_SHOWN_CHARS = 200  # of a reply quoted in an error


class JudgeError(RuntimeError):
    """One sample's grade could not be had: the message says why (HTTP status, timeout, the reply)."""


class Judge:
    """The judge term's reward function: `judge(sample)` is the sample's reward in [0, 1]."""

    def __init__(self, cfg: JudgeConfig, *, key: str):
        self.cfg = cfg
        self.pattern = re.compile(cfg.score_pattern)
        self.endpoint = cfg.url.rstrip("/") + ("/chat/completions" if cfg.api == "chat" else "/completions")
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key_env is not None:
            if cfg.api_key_env not in os.environ:
                raise RecipeError(f"{key}.judge.api_key_env: the environment variable {cfg.api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {os.environ[cfg.api_key_env]}"
        self.prefetched: dict[int, float | Exception] = {}  # id(sample) -> its reward or error, of one batch

    def prefetch(self, samples: Sequence) -> None:
        """Grade every sample of a batch, `max_concurrency` requests at a time; `__call__` then hands out each
        sample's outcome. The samples must stay alive until they are scored (they are looked up by id)."""
        self.prefetched = {}
        if not samples:
            return
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(samples))) as pool:
            outcomes = list(pool.map(self._outcome, samples))
        self.prefetched = {id(sample): outcome for sample, outcome in zip(samples, outcomes)}

    def __call__(self, sample) -> float:
        outcome = self.prefetched.pop(id(sample), None)
        if outcome is None:  # not part of a prefetched batch: ask now
            return self.grade(sample)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _outcome(self, sample) -> float | Exception:
        try:
            return self.grade(sample)
        except Exception as e:  # noqa: BLE001 - raised again when the sample is scored
            return e

    def grade(self, sample) -> float:
        """One request: the sample's reward, or JudgeError."""
        cfg = self.cfg
        text = cfg.template.format(question=sample.prompt, response=sample.response, reference=sample.answer)
        return self.reward(self.ask(text))

    def ask(self, text: str) -> str:
        """The judge's reply to `text`."""
        cfg = self.cfg
        body = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
        body |= {"messages": [{"role": "user", "content": text}]} if cfg.api == "chat" else {"prompt": text}
        request = urllib.request.Request(self.endpoint, data=json.dumps(body).encode(), headers=self.headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=cfg.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:REPLY_SHOWN_CHARS].decode(errors="replace")
            raise JudgeError(f"HTTP {e.code} from {self.endpoint}: {detail}") from None
        except (TimeoutError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise JudgeError(f"no reply from {self.endpoint} within timeout_s = {cfg.timeout_s} s") from None
            raise JudgeError(f"cannot reach {self.endpoint}: {reason}") from None
        except (OSError, http.client.HTTPException) as e:  # the connection broke while reading the reply
            raise JudgeError(f"the request to {self.endpoint} failed: {type(e).__name__}: {e}") from None
        return reply_text(raw, chat=cfg.api == "chat")

    def reward(self, reply: str) -> float:
        """The score in `reply` (the last match of the pattern) mapped from [min_score, max_score] to [0, 1]."""
        cfg = self.cfg
        matches = list(self.pattern.finditer(reply))
        shown = reply[-REPLY_SHOWN_CHARS:]
        if not matches:
            raise JudgeError(f"no score in the reply (score_pattern {cfg.score_pattern!r}): {shown!r}")
        try:
            score = float(matches[-1].group("score"))
        except (TypeError, ValueError):
            raise JudgeError(f"the score {matches[-1].group('score')!r} is not a number: {shown!r}") from None
        if not (math.isfinite(score) and cfg.min_score <= score <= cfg.max_score):
            raise JudgeError(f"the score {score:g} is outside [{cfg.min_score:g}, {cfg.max_score:g}]: {shown!r}")
        return (score - cfg.min_score) / (cfg.max_score - cfg.min_score)


def reply_text(raw: bytes, *, chat: bool) -> str:
    """The text of an OpenAI-compatible reply body: choices[0].message.content (chat) or choices[0].text;
    JudgeError, quoting the body, when it is not that."""
    shown = raw[:REPLY_SHOWN_CHARS].decode(errors="replace")
    try:
        choice = json.loads(raw)["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        where = "choices[0].message.content" if chat else "choices[0].text"
        raise JudgeError(f"the reply is not an OpenAI-compatible body with {where}: {shown!r}") from None
    if not isinstance(text, str):
        raise JudgeError(f"the reply's text is {type(text).__name__}, not a string: {shown!r}")
    return text
