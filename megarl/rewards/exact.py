"""Exact-answer reward: the response's first line, stripped, must equal the reference answer."""

from __future__ import annotations

EOS_MARKERS = ("<|endoftext|>", "<|im_end|>")


def response_answer(response: str) -> str:
    """The answer a response gives: its text before the first newline or end-of-text marker, stripped.

    Rollout engines usually drop the EOS token from decoded text, but when special tokens are kept the
    markers in EOS_MARKERS end the answer as a newline does. Whitespace around the answer is ignored;
    anything else after it on the first line (`82 apples`, `82.`) makes it a different answer.
    """
    for marker in EOS_MARKERS:
        response = response.split(marker, 1)[0]
    return response.split("\n", 1)[0].strip()


def exact_answer_reward(response: str, answer: str) -> float:
    """1.0 when `response_answer(response)` equals `answer` stripped, else 0.0."""
    return 1.0 if response_answer(response) == answer.strip() else 0.0
