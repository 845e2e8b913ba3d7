"""Addition problems for the quickstart: train and held-out splits that share no pair of operands.

    python -m megarl.data.arithmetic --out DIR [--seed N] [--digits 2] [--train-size 4000] [--heldout-size 256]

Each row is `{"prompt": "37+45=", "answer": "82"}`. Operands are drawn from [0, 10**digits). A problem is held
out as an unordered pair: when `37+45=` is held out, so is `45+37=`, so a model cannot pass a held-out problem by
remembering its mirror image from training. What transfers from train to held-out is the digit-wise procedure,
which is what makes a rising held-out reward an honest sign of learning rather than of memorising.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def addition_row(a: int, b: int) -> dict[str, str]:
    """The JSONL row of the problem a + b."""
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def make_arithmetic_splits(out_dir: str | Path, *, seed: int = 0, digits: int = 2, train_size: int = 4000,
                           heldout_size: int = 256) -> tuple[Path, Path]:
    """Write `train.jsonl` and `heldout.jsonl` under `out_dir` and return their paths.

    Unordered operand pairs {a, b} are shuffled with `seed`; the first pairs give `heldout_size` held-out
    problems (both orders of a pair count, so a pair may contribute two rows) and the remaining pairs give
    `train_size` train problems. Same arguments, same bytes.
    """
    n = 10 ** digits
    pairs = [(a, b) for a in range(n) for b in range(a, n)]
    random.Random(seed).shuffle(pairs)
    heldout, train = [], []
    for a, b in pairs:
        if len(train) >= train_size:
            break
        rows = heldout if len(heldout) < heldout_size else train
        rows.extend(addition_row(x, y) for x, y in ([(a, b)] if a == b else [(a, b), (b, a)]))
    if len(heldout) < heldout_size or len(train) < train_size:
        raise ValueError(f"{digits}-digit addition has {n * n} problems, fewer than the "
                         f"{heldout_size} held-out + {train_size} train asked for")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    for path, rows in zip(paths, (train[:train_size], heldout[:heldout_size])):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pair shuffle")
    parser.add_argument("--digits", type=int, default=2, help="operands are in [0, 10**digits)")
    parser.add_argument("--train-size", type=int, default=4000, help="rows in train.jsonl")
    parser.add_argument("--heldout-size", type=int, default=256, help="rows in heldout.jsonl")
    args = parser.parse_args(argv)
    train, heldout = make_arithmetic_splits(args.out, seed=args.seed, digits=args.digits,
                                            train_size=args.train_size, heldout_size=args.heldout_size)
    print(f"wrote {train} and {heldout}")


if __name__ == "__main__":
    main()
