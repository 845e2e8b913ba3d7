"""The math reward on a hand-written table of GSM8K- and MATH-style references and responses (right, wrong,
malformed), and on every row of the generated example sets."""

from __future__ import annotations

import json

import pytest

from megarl.data.math_word import make_math_word_sets
from megarl.rewards.math_answer import gsm8k_final_answer, math_reward, parse_reference

GSM8K_SOLUTION = "Natalia sold 48 / 2 = 24 clips in May.\nAltogether she sold 48 + 24 = 72 clips.\n#### 72"

TABLE = [
    # GSM8K references (worked solution ending in #### N)
    (GSM8K_SOLUTION, "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    (GSM8K_SOLUTION, "#### 72.0", 1.0),  # the same number, written as a decimal
    (GSM8K_SOLUTION, "The answer is $\\boxed{72}$.", 1.0),  # a boxed answer to a GSM8K question
    (GSM8K_SOLUTION, "So she sold 72 clips in all.", 1.0),  # free text: the last number counts
    (GSM8K_SOLUTION, "#### 71", 0.0),
    (GSM8K_SOLUTION, "48 + 24 = 72, but then she lost 2, so 70", 0.0),  # the last number is the answer
    (GSM8K_SOLUTION, "#### seventy-two", 0.0),  # words are not a number
    (GSM8K_SOLUTION, "", 0.0),
    (GSM8K_SOLUTION, "I don't know.", 0.0),
    ("Each costs $1,250.\n#### 1,250", "#### 1250", 1.0),  # thousands separators in the reference
    ("#### 1250", "The total is $1,250.\n#### 1,250", 1.0),  # ...and in the response
    ("#### 18", "#### $18", 1.0),  # a currency sign on the answer
    ("#### -5", "#### -5", 1.0),
    ("#### -5", "#### 5", 0.0),
    # MATH references (LaTeX answer, bare or boxed in a solution)
    ("\\frac{1}{2}", "Thus the answer is $\\boxed{\\frac{1}{2}}$.", 1.0),
    ("\\frac{1}{2}", "$\\boxed{\\dfrac12}$", 1.0),  # \dfrac and the brace-less \frac12
    ("\\frac{1}{2}", "$\\boxed{0.5}$", 1.0),  # a decimal equal to the fraction
    ("\\frac{1}{2}", "$\\boxed{2/4}$", 1.0),  # an unreduced fraction is the same number
    ("\\frac{1}{2}", "$\\boxed{\\frac{1}{3}}$", 0.0),
    ("\\frac{1}{3}", "$\\boxed{0.333}$", 0.0),  # a rounded decimal is a different number
    ("-\\frac{3}{4}", "The answer is $\\boxed{-\\frac{3}{4}}$", 1.0),
    ("-\\frac{3}{4}", "The answer is $\\boxed{\\frac{3}{4}}$", 0.0),  # the sign matters
    ("3\\sqrt{2}", "$\\boxed{\\sqrt{18}}$", 1.0),  # equal radicals
    ("3\\sqrt{2}", "$\\boxed{2\\sqrt{3}}$", 0.0),
    ("3\\sqrt{2}", "#### \\sqrt{18}", 1.0),  # LaTeX after #### is read as LaTeX
    ("\\pi", "$\\boxed{\\pi}$", 1.0),
    ("\\pi", "$\\boxed{3.14}$", 0.0),
    ("x^2 + 2x + 1", "$\\boxed{(x+1)^2}$", 1.0),  # symbolic equality
    ("x^2 + 2x + 1", "$\\boxed{(x-1)^2}$", 0.0),
    ("5\\%", "$\\boxed{0.05}$", 1.0),
    ("(1, 2)", "$\\boxed{(1,2)}$", 1.0),  # tuples
    ("(1, 2)", "$\\boxed{(2,1)}$", 0.0),
    ("The solution gives $\\boxed{12}$.", "$\\boxed{12}$", 1.0),  # a full MATH solution as the reference
    ("\\frac{1}{2}", "$\\boxed{\\frac{1}{", 0.0),  # a cut-off fraction
    ("\\frac{1}{2}", "\\boxed{}", 0.0),  # an empty box
]


@pytest.mark.parametrize("answer, response, expected", TABLE)
def test_math_reward_table(answer, response, expected):
    assert math_reward(response, answer) == expected


def test_gsm8k_final_answer_is_the_last_mark_up_to_its_line_end():
    assert gsm8k_final_answer(GSM8K_SOLUTION) == "72"
    assert gsm8k_final_answer("#### 3\nthen\n#### 4 \nmore text") == "4"
    assert gsm8k_final_answer("no mark") is None
    assert gsm8k_final_answer("####") == ""


@pytest.mark.parametrize("answer", ["#### ", "#### \\frac{", "", "\\frac{1}{"])
def test_an_unparsable_reference_raises_for_the_failure_policy(answer):
    with pytest.raises(ValueError, match="no parsable final answer"):
        parse_reference(answer)


def test_generated_sets_verify_their_own_answers_and_reject_off_by_one(tmp_path):
    gsm8k, math_style = make_math_word_sets(tmp_path, seed=5, size=40)
    for line in gsm8k.read_text().splitlines():
        row = json.loads(line)
        n = int(row["answer"].rsplit("####", 1)[1])
        assert math_reward(f"Work...\n#### {n}", row["answer"]) == 1.0, row
        assert math_reward(f"Work...\n#### {n + 1}", row["answer"]) == 0.0, row
    for line in math_style.read_text().splitlines():
        row = json.loads(line)
        assert math_reward(f"So the answer is $\\boxed{{{row['answer']}}}$.", row["answer"]) == 1.0, row
        assert math_reward(f"So the answer is $\\boxed{{{row['answer']} + 1}}$.", row["answer"]) == 0.0, row
