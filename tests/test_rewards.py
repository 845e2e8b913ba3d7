"""The exact-answer reward on hand-written responses."""

from __future__ import annotations

import pytest

from megarl.rewards.exact import exact_answer_reward, response_answer


@pytest.mark.parametrize("response, answer, reward", [
    ("9130", "9130", 1.0),
    ("  9130 ", "9130", 1.0),  # surrounding whitespace is ignored
    ("9130\n2+2=4", "9130", 1.0),  # the answer ends at the first newline
    ("9130<|endoftext|>junk", "9130", 1.0),  # ...or at an end-of-text marker left in the text
    ("9130<|im_end|>", "9130", 1.0),
    ("9131", "9130", 0.0),
    ("91300", "9130", 0.0),  # a longer answer is a different answer
    ("913", "9130", 0.0),
    ("9130.", "9130", 0.0),
    ("\n9130", "9130", 0.0),  # an empty first line is an empty answer
    ("", "9130", 0.0),
    ("", "", 1.0),
    ("82", " 82\n", 1.0),  # the reference is stripped too
])
def test_exact_answer_reward(response, answer, reward):
    assert exact_answer_reward(response, answer) == reward


def test_response_answer_is_the_first_line_stripped():
    assert response_answer(" 12 + 3 \nmore") == "12 + 3"
    assert response_answer("<|endoftext|>12") == ""
