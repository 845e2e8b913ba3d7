"""The `judge` reward term: a generative model grades each response, asked over an OpenAI-compatible HTTP API
or run by megarl's native engine in the scoring process.

    reward:
      terms:
        - kind: judge
          judge: {url: "http://localhost:30000/v1", api: chat, max_concurrency: 8, timeout_s: 60}
        - kind: judge
          judge: {path: /ckpt/judge-model, api: chat, max_concurrency: 32}   # a local checkpoint

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

With `path`, the judge is that HF checkpoint and its tokenizer (its chat template for `api: chat`), loaded at
the first grade in each scoring process and kept there: the batch's prompts go to megarl's native engine
`max_concurrency` at a time, decoded greedily at temperature 0 (the default); each reply is the response
decoded without special tokens. Such a judge holds its weights on the scoring process's device for the whole
run (in `judge.dtype`), as a reward_model term does; a judge too large for that is served over HTTP instead
(SGLang's own server: `python -m sglang.launch_server --model-path ...`, then `url`).
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
        self.cfg, self.key = cfg, key
        self.pattern = re.compile(cfg.score_pattern)
        self.local: LocalJudge | None = None  # a `path` judge, loaded at its first grade
        self.endpoint = None if cfg.url is None else (
            cfg.url.rstrip("/") + ("/chat/completions" if cfg.api == "chat" else "/completions"))
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
        if self.cfg.path is not None:
            outcomes = self._local_outcomes(samples)
        else:
            with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(samples))) as pool:
                outcomes = list(pool.map(self._outcome, samples))
        self.prefetched = {id(sample): outcome for sample, outcome in zip(samples, outcomes)}

    def _local_outcomes(self, samples: Sequence) -> list[float | Exception]:
        """The local judge's grades, its replies generated `max_concurrency` prompts at a time; a batch whose
        generation fails fails each of its samples."""
        outcomes: list[float | Exception] = []
        step = self.cfg.max_concurrency
        for start in range(0, len(samples), step):
            texts = [self.prompt(sample) for sample in samples[start:start + step]]
            try:
                replies = self._local_judge().replies(texts)
            except RecipeError:
                raise
            except Exception as e:  # noqa: BLE001 - each sample of the batch fails with it
                failed = JudgeError(f"the judge model in {self.cfg.path} failed: {type(e).__name__}: {e}")
                outcomes += [failed] * len(texts)
                continue
            for reply in replies:
                try:
                    outcomes.append(self.reward(reply))
                except JudgeError as e:
                    outcomes.append(e)
        return outcomes

    def _local_judge(self) -> LocalJudge:
        if self.local is None:
            self.local = LocalJudge(self.cfg, key=self.key)
        return self.local

    def prompt(self, sample) -> str:
        """The judge's prompt for one sample: the template filled in."""
        return self.cfg.template.format(question=sample.prompt, response=sample.response, reference=sample.answer)

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
        return self.reward(self.ask(self.prompt(sample)))

    def ask(self, text: str) -> str:
        """The judge's reply to `text`."""
        cfg = self.cfg
        if cfg.path is not None:
            return self._local_judge().replies([text])[0]
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


class LocalJudge:
    """A judge checkpoint (`judge.path`) and its tokenizer, generating with megarl's native engine in this
    process, on its device."""

    def __init__(self, cfg: JudgeConfig, *, key: str):
        from transformers import AutoTokenizer

        from megarl.rollout.native import NativeEngine

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        if cfg.api == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise RecipeError(f"{key}.judge.api = 'chat': the tokenizer in {cfg.path} has no chat template; use "
                              "api: completions (the filled template as the raw prompt)")
        self.eos = self.tokenizer.eos_token_id
        if self.eos is None:
            raise RecipeError(f"{key}.judge.path: the tokenizer in {cfg.path} has no EOS token, so a reply could "
                              "only end at max_tokens")
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        self.engine = NativeEngine(cfg.path, dtype=cfg.dtype, seed=0)

    def token_ids(self, text: str) -> list[int]:
        """The prompt's token ids: the user message in the chat template (api chat), or the text as it is."""
        if self.cfg.api == "chat":
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def replies(self, texts: list[str]) -> list[str]:
        """The judge's reply to each prompt, one batch."""
        cfg = self.cfg
        generation = self.engine.generate([self.token_ids(text) for text in texts], temperature=cfg.temperature,
                                          top_p=1.0, max_new_tokens=cfg.max_tokens, eos_id=self.eos, pad_id=self.pad)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in generation.response_ids]
