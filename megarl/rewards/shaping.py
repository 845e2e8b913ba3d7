"""Shaping terms that look at the form of a response, not its correctness: a format check and a length
penalty. Both are pure functions of the response."""

from __future__ import annotations

import re


def format_reward(response: str, pattern: re.Pattern) -> float:
    """1.0 when `pattern` is found anywhere in the response, else 0.0. Compile the pattern with re.DOTALL so
    `.` crosses lines; anchor it with `\\A` and `\\Z` to require that the whole response has the format."""
    return 1.0 if pattern.search(response) else 0.0


def length_penalty(response_tokens: int, *, max_tokens: int, cache_tokens: int) -> float:
    """The overlong penalty of DAPO (Yu et al. 2025, eq. 13): 0 up to `max_tokens - cache_tokens` response
    tokens, then falling linearly to -1 at `max_tokens`, and -1 beyond. A response cut at the generation
    limit usually hits -1, which is the point: it teaches the policy to finish before the limit."""
    start = max_tokens - cache_tokens
    if response_tokens <= start:
        return 0.0
    return -min(1.0, (response_tokens - start) / cache_tokens)
