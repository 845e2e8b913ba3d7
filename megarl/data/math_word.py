"""Two small example math sets, generated from templates (nothing is downloaded): GSM8K-style word problems
whose answers are worked solutions ending in `#### N`, and MATH-style problems whose answers are LaTeX
(integers, common fractions, radicals) as they would appear inside `\\boxed{}`.

    python -m megarl.data.math_word --out DIR [--seed N] [--size 1000]

writes DIR/gsm8k_style.jsonl and DIR/math_style.jsonl, rows like

    {"prompt": "Ava has 12 marbles. ...", "answer": "Ava buys 3 * 4 = 12 ...\\n#### 24", "template": "buy_packs"}
    {"prompt": "Compute $\\frac{1}{3} + \\frac{1}{6}$. ...", "answer": "\\frac{1}{2}", "subject": "fractions"}

They exist to exercise the `math` reward and the data path end to end with answers in the two formats real
sets use; the numbers are small so a tiny model's failures are about format, not arithmetic range.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from fractions import Fraction
from pathlib import Path

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas")
ITEMS = ("marbles", "stickers", "apples", "pencils", "cards", "shells")


# ---- GSM8K style: (prompt, worked solution ending in "#### N") --------------------------------------------
def _buy_packs(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have, packs, per_pack = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 12)
    bought = packs * per_pack
    total = have + bought
    return (f"{name} has {have} {item}. {name} buys {packs} packs with {per_pack} {item} in each pack. "
            f"How many {item} does {name} have now?",
            f"{name} buys {packs} * {per_pack} = {bought} {item}.\n{name} now has {have} + {bought} = {total} {item}.",
            total)


def _change(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    price, count = rng.randint(2, 15), rng.randint(2, 6)
    cost = price * count
    bill = rng.choice([b for b in (20, 50, 100) if b >= cost])
    return (f"A shop sells {item} for ${price} each. {name} buys {count} of them and pays with a ${bill} bill. "
            f"How many dollars of change does {name} get?",
            f"The {item} cost {count} * {price} = ${cost}.\nThe change is {bill} - {cost} = ${bill - cost}.",
            bill - cost)


def _reading(rng: random.Random) -> tuple[str, str, int]:
    name = rng.choice(NAMES)
    a, d1, b, d2 = rng.randint(5, 30), rng.randint(2, 7), rng.randint(5, 30), rng.randint(2, 7)
    total = a * d1 + b * d2
    return (f"{name} reads {a} pages a day for {d1} days, then {b} pages a day for {d2} days. "
            f"How many pages does {name} read in all?",
            f"First {a} * {d1} = {a * d1} pages.\nThen {b} * {d2} = {b * d2} pages.\n"
            f"In all {a * d1} + {b * d2} = {total} pages.",
            total)


def _share(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, kept = rng.randint(2, 8), rng.randint(3, 25), rng.randint(1, 20)
    total = friends * each + kept
    return (f"{name} had some {item}, gave {each} to each of {friends} friends and kept {kept}. "
            f"How many {item} did {name} have at first?",
            f"{name} gave away {friends} * {each} = {friends * each} {item}.\n"
            f"At first {name} had {friends * each} + {kept} = {total} {item}.",
            total)


def _big_order(rng: random.Random) -> tuple[str, str, int]:
    crates, per_crate, price = rng.randint(20, 90), rng.randint(24, 60), rng.randint(2, 9)
    units = crates * per_crate
    total = units * price
    # Answers over 999 are written with thousands separators in the solution text, as GSM8K often does,
    # while the `#### N` line stays a plain integer.
    return (f"A warehouse ships {crates} crates with {per_crate} bottles in each, at ${price} per bottle. "
            f"How many dollars are the bottles worth?",
            f"There are {crates} * {per_crate} = {units:,} bottles.\nThey are worth {units:,} * {price} = ${total:,}.",
            total)


GSM8K_TEMPLATES = {"buy_packs": _buy_packs, "change": _change, "reading": _reading, "share": _share,
                   "big_order": _big_order}


def gsm8k_style_row(rng: random.Random) -> dict:
    template = rng.choice(sorted(GSM8K_TEMPLATES))
    prompt, solution, answer = GSM8K_TEMPLATES[template](rng)
    return {"prompt": prompt, "answer": f"{solution}\n#### {answer}", "template": template}


# ---- MATH style: (prompt, LaTeX answer) ----------------------------------------------------------------------
def latex_number(x: Fraction) -> str:
    """An integer as digits, any other rational as a reduced common fraction: -\\frac{3}{4}."""
    if x.denominator == 1:
        return str(x.numerator)
    sign = "-" if x < 0 else ""
    return f"{sign}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def _fraction_sum(rng: random.Random) -> tuple[str, str]:
    a, b = Fraction(rng.randint(1, 9), rng.randint(2, 12)), Fraction(rng.randint(1, 9), rng.randint(2, 12))
    op = rng.choice("+-")
    result = a + b if op == "+" else a - b
    return (f"Compute ${latex_number(a)} {op} {latex_number(b)}$. Express your answer as a common fraction.",
            latex_number(result))


def _linear(rng: random.Random) -> tuple[str, str]:
    a = rng.choice([n for n in range(-9, 10) if n not in (0, 1)])
    b, c = rng.randint(-20, 20), rng.randint(-20, 20)
    x = Fraction(c - b, a)
    b_text = f"+ {b}" if b >= 0 else f"- {-b}"
    return f"Solve for $x$: ${a}x {b_text} = {c}$.", latex_number(x)


def _radical(rng: random.Random) -> tuple[str, str]:
    outer, inner = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7, 10, 11])
    return f"Simplify $\\sqrt{{{outer * outer * inner}}}$.", f"{outer}\\sqrt{{{inner}}}"


def _probability(rng: random.Random) -> tuple[str, str]:
    red, blue = rng.randint(1, 12), rng.randint(1, 12)
    return (f"A bag holds {red} red and {blue} blue marbles. One marble is drawn at random. What is the "
            f"probability that it is red? Express your answer as a common fraction.",
            latex_number(Fraction(red, red + blue)))


def _gcd_lcm(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(4, 60), rng.randint(4, 60)
    if rng.random() < 0.5:
        return f"What is the greatest common divisor of ${a}$ and ${b}$?", str(math.gcd(a, b))
    return f"What is the least common multiple of ${a}$ and ${b}$?", str(math.lcm(a, b))


MATH_TEMPLATES = {"fractions": _fraction_sum, "algebra": _linear, "radicals": _radical,
                  "probability": _probability, "number_theory": _gcd_lcm}


def math_style_row(rng: random.Random) -> dict:
    subject = rng.choice(sorted(MATH_TEMPLATES))
    prompt, answer = MATH_TEMPLATES[subject](rng)
    return {"prompt": prompt + " Put your final answer in \\boxed{}.", "answer": answer, "subject": subject}


def make_math_word_sets(out_dir: str | Path, *, seed: int = 0, size: int = 1000) -> tuple[Path, Path]:
    """Write `gsm8k_style.jsonl` and `math_style.jsonl` (`size` rows each) and return their paths.
    Same arguments, same bytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "gsm8k_style.jsonl", out_dir / "math_style.jsonl"
    for path, make_row, salt in zip(paths, (gsm8k_style_row, math_style_row), ("gsm8k", "math")):
        rng = random.Random(f"{seed}:{salt}")
        path.write_text("".join(json.dumps(make_row(rng)) + "\n" for _ in range(size)))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for gsm8k_style.jsonl and math_style.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of both generators")
    parser.add_argument("--size", type=int, default=1000, help="rows in each file")
    args = parser.parse_args(argv)
    gsm8k, math_style = make_math_word_sets(args.out, seed=args.seed, size=args.size)
    print(f"wrote {gsm8k} and {math_style}")


if __name__ == "__main__":
    main()
