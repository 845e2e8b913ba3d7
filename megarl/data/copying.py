"""Digit copying, a task whose preferences a tiny reward model can learn: train and held-out splits, and
preference pairs whose rejected responses are the mistakes a half-trained policy makes.

    python -m megarl.data.copying --out DIR [--seed N] [--digits 6] [--train-size 20000] [--heldout-size 256]

A row asks for the prompt's digits again: {"prompt": "565003=", "answer": "565003"}. Every string is drawn
uniformly from the 10**digits there are, and no string is in both splits.

`train_pairs.jsonl` and `heldout_pairs.jsonl` hold every row once more as {"prompt", "chosen", "rejected"}:
chosen the answer, rejected a wrong response of one of three kinds (REJECTED_KINDS), drawn with these odds:

- 70 %: one to three of the digits replaced by other digits (one digit in half of these, two or three in a
  quarter each): the near miss that dominates a policy's wrong samples here;
- 15 %: one digit dropped or one inserted, so the answer has the wrong length;
- 15 %: printable characters, none to `digits + 2` of them: what a policy writes before it has learned the form.

A reward model trained on the arithmetic pairs (megarl.data.arithmetic) would have to learn addition to rank
a policy's near misses; here it has to compare each digit of the response with the prompt's digit in the same
place, which two attention layers can do. That is what lets an RL run with a trained reward model as its only
reward be checked against the exact answer (docs/sft-dpo-rm.md, "RLHF: PPO on a trained reward model").
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

DIGITS = string.digits
PRINTABLE = [chr(c) for c in range(32, 127)]
REJECTED_KINDS = (("replaced", 0.70), ("length", 0.15), ("printable", 0.15))


def wrong_copy(answer: str, rng: random.Random) -> tuple[str, str]:
    """(a response that is not `answer`, its kind from REJECTED_KINDS), drawn with the kinds' odds."""
    kind = rng.choices([k for k, _ in REJECTED_KINDS], weights=[w for _, w in REJECTED_KINDS])[0]
    if kind == "replaced":
        chars = list(answer)
        for i in rng.sample(range(len(chars)), min(len(chars), rng.choice((1, 1, 2, 3)))):
            chars[i] = rng.choice(DIGITS.replace(chars[i], ""))
        return "".join(chars), kind
    if kind == "length":
        if rng.random() < 0.5 and len(answer) > 1:
            i = rng.randrange(len(answer))
            return answer[:i] + answer[i + 1:], kind
        i = rng.randrange(len(answer) + 1)
        return answer[:i] + rng.choice(DIGITS) + answer[i:], kind
    while True:  # printable characters that happen to spell the answer are drawn again
        text = "".join(rng.choice(PRINTABLE) for _ in range(rng.randrange(len(answer) + 3)))
        if text != answer:
            return text, kind


def make_copying_splits(out_dir: str | Path, *, seed: int = 0, digits: int = 6, train_size: int = 20000,
                        heldout_size: int = 256) -> list[Path]:
    """Write train.jsonl, heldout.jsonl, train_pairs.jsonl and heldout_pairs.jsonl under `out_dir` and return
    their paths in that order. Same arguments, same bytes."""
    if heldout_size + train_size > 10 ** digits // 2:
        raise ValueError(f"{digits}-digit strings are too few for {heldout_size} held-out + {train_size} train "
                         f"rows drawn without repeats (at most half of the {10 ** digits} strings)")
    rng = random.Random(seed)
    drawn: set[str] = set()
    splits = {}
    for name, size in (("heldout", heldout_size), ("train", train_size)):
        rows = []
        while len(rows) < size:
            text = "".join(rng.choice(DIGITS) for _ in range(digits))
            if text not in drawn:
                drawn.add(text)
                rows.append(text)
        splits[name] = rows
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("train", "heldout"):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{s}=", "answer": s}) + "\n" for s in splits[name]))
        paths.append(path)
    for name in ("train", "heldout"):
        pair_rng = random.Random(f"{seed}:pairs:{name}")  # each split its own draws
        path = out_dir / f"{name}_pairs.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{s}=", "chosen": s, "rejected": wrong_copy(s, pair_rng)[0]})
                                + "\n" for s in splits[name]))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the splits and their preference pairs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the strings and of the rejected responses")
    parser.add_argument("--digits", type=int, default=6, help="digits to copy")
    parser.add_argument("--train-size", type=int, default=20000, help="rows in train.jsonl")
    parser.add_argument("--heldout-size", type=int, default=256, help="rows in heldout.jsonl")
    args = parser.parse_args(argv)
    paths = make_copying_splits(args.out, seed=args.seed, digits=args.digits, train_size=args.train_size,
                                heldout_size=args.heldout_size)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
