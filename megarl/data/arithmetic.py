"""Little-endian addition problems for the quickstart: train and held-out splits that share no operand pair.

    python -m megarl.data.arithmetic --out DIR [--seed N] [--digits 3] [--train-size 20000] [--heldout-size 256]
                                     [--pairs]

Every number is written least-significant digit first and zero-padded to a fixed width: operands with `digits`
digits, the sum with `digits + 1`. So 41 + 278 = 319 with 3 digits is the row

    {"prompt": "140+872=", "answer": "9130"}

Little-endian order is what lets a two-layer model learn the procedure from a few hundred SFT steps: each answer
digit depends on the column it sits in and on the carry out of the digit written just before it, the same
positions for every problem. In the usual order the first digit written depends on the carry of the whole sum.

A problem is held out as an unordered pair: when `140+872=` is held out, so is `872+140=`, so no held-out
problem can be answered by recalling its mirror image from training. With 3 digits there are 500,500 pairs and
the train split sees a few percent of them; only the digit-wise procedure carries over to held-out problems,
which is what makes a rising held-out reward an honest sign of learning.

The same rows serve SFT (the answer is the response) and, with `--pairs`, DPO: `train_pairs.jsonl` and
`heldout_pairs.jsonl` hold each problem once more as {"prompt", "chosen", "rejected"}, chosen the correct sum
and rejected a different number of the same width drawn uniformly at random.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def little_endian(n: int, width: int) -> str:
    """`n` zero-padded to `width` digits, least significant digit first: little_endian(41, 3) == "140"."""
    return str(n).zfill(width)[::-1]


def addition_row(a: int, b: int, *, digits: int) -> dict[str, str]:
    """The JSONL row of the problem a + b, operands `digits` wide and the sum `digits + 1` wide."""
    return {"prompt": f"{little_endian(a, digits)}+{little_endian(b, digits)}=",
            "answer": little_endian(a + b, digits + 1)}


def make_arithmetic_splits(out_dir: str | Path, *, seed: int = 0, digits: int = 3, train_size: int = 20000,
                           heldout_size: int = 256) -> tuple[Path, Path]:
    """Write `train.jsonl` and `heldout.jsonl` under `out_dir` and return their paths (train first).

    Unordered operand pairs {a, b} with a, b in [0, 10**digits) are shuffled with `seed`. The first pairs fill
    the held-out split and the following ones the train split; a pair contributes both of its orders to the
    split it lands in (truncating a split may drop one order, never move it to the other split). Same
    arguments, same bytes.
    """
    n = 10 ** digits
    pairs = [(a, b) for a in range(n) for b in range(a, n)]
    if 2 * len(pairs) - n < heldout_size + train_size:
        raise ValueError(f"{digits}-digit addition has {n * n} problems, fewer than the "
                         f"{heldout_size} held-out + {train_size} train asked for")
    random.Random(seed).shuffle(pairs)
    heldout, train = [], []
    for a, b in pairs:
        if len(train) >= train_size:
            break
        split = heldout if len(heldout) < heldout_size else train
        split.extend(addition_row(x, y, digits=digits) for x, y in ([(a, b)] if a == b else [(a, b), (b, a)]))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    for path, rows in zip(paths, (train[:train_size], heldout[:heldout_size])):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def write_preference_pairs(split: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """Rewrite a {prompt, answer} split as {prompt, chosen, rejected} pairs at `out`: chosen is the answer,
    rejected a uniformly drawn different number of the same width, little-endian. Same arguments, same bytes."""
    rng = random.Random(f"{seed}:pairs:{Path(split).name}")  # each split its own draws
    lines = []
    for line in Path(split).read_text().splitlines():
        row = json.loads(line)
        width = len(row["answer"])
        correct = int(row["answer"][::-1])
        wrong = rng.randrange(10 ** width - 1)
        wrong += wrong >= correct  # skip the correct value: uniform over the others
        lines.append(json.dumps({"prompt": row["prompt"], "chosen": row["answer"],
                                 "rejected": little_endian(wrong, width)}) + "\n")
    Path(out).write_text("".join(lines))
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pair shuffle")
    parser.add_argument("--digits", type=int, default=3, help="operands are in [0, 10**digits)")
    parser.add_argument("--train-size", type=int, default=20000, help="rows in train.jsonl")
    parser.add_argument("--heldout-size", type=int, default=256, help="rows in heldout.jsonl")
    parser.add_argument("--pairs", action="store_true",
                        help="also write train_pairs.jsonl and heldout_pairs.jsonl (preference pairs for DPO)")
    args = parser.parse_args(argv)
    train, heldout = make_arithmetic_splits(args.out, seed=args.seed, digits=args.digits,
                                            train_size=args.train_size, heldout_size=args.heldout_size)
    print(f"wrote {train} and {heldout}")
    if args.pairs:
        written = [write_preference_pairs(split, split.with_name(f"{split.stem}_pairs.jsonl"), seed=args.seed)
                   for split in (train, heldout)]
        print(f"wrote {written[0]} and {written[1]}")


if __name__ == "__main__":
    main()
