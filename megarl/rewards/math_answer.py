"""Math answer reward: extract the final answer of a response and check it against the reference with
math-verify (numbers, fractions, radicals, percentages, LaTeX expressions compared symbolically).

Two answer conventions are understood, in a reference as in a response:
- GSM8K: a worked solution whose last `#### N` line holds the answer (`#### 1,234`);
- MATH: LaTeX, either bare (`\\frac{3}{4}`, the usual reference) or inside `\\boxed{}` in a solution.
A response with neither is read the way math-verify reads free text: boxed answers first, then an
"answer is" phrase, then the last expression in the text.

math-verify is imported when the first answer is checked (it pulls in sympy, about half a second).
"""

from __future__ import annotations

import functools
import logging

GSM8K_MARK = "####"


def gsm8k_final_answer(text: str) -> str | None:
    """The answer after the last `####` of `text` (up to the end of its line), stripped; None if absent."""
    if GSM8K_MARK not in text:
        return None
    return text.rsplit(GSM8K_MARK, 1)[1].split("\n", 1)[0].strip()


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals the reference mathematically, else 0.0.

    A response without any answer scores 0.0; a reference that cannot be parsed raises ValueError, because
    that is a broken dataset row, which the caller's failure policy reports, not a wrong response.
    """
    from math_verify import verify

    gold = parse_reference(answer)
    predicted = _parse(_as_latex(gsm8k_final_answer(response)) if GSM8K_MARK in response else response)
    if not predicted:
        return 0.0
    # The caller bounds the time of a whole sample (scorer.time_limit), so math-verify's own timers stay off:
    # they use the same SIGALRM and would cancel the caller's.
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


@functools.lru_cache(maxsize=4096)
def parse_reference(answer: str) -> list:
    """The parsed reference answer (cached: every sample of a prompt shares it). ValueError if unparsable."""
    if GSM8K_MARK in answer:
        text = _as_latex(gsm8k_final_answer(answer))
    elif "\\boxed" in answer or "$" in answer:
        text = answer
    else:
        text = _as_latex(answer.strip())
    parsed = _parse(text)
    if not parsed or isinstance(parsed[0], str):  # only the raw text came back: nothing parsed as math
        raise ValueError(f"reference answer {answer[-200:]!r} has no parsable final answer")
    return parsed


def _as_latex(answer: str) -> str:
    """Wrap a bare answer in `$...$` so that math-verify parses it as one LaTeX expression (`\\sqrt{18}` is
    otherwise not found in plain text). A GSM8K answer may carry a currency sign, which is not math."""
    return f"${answer.lstrip('$').strip()}$"


def _parse(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    _quiet_timeout_notice()
    return parse(text, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                 parsing_timeout=None)


@functools.cache
def _quiet_timeout_notice() -> None:
    """math-verify warns once that its timeouts are off and the caller must bound the time; we do."""
    def keep(record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(keep)
