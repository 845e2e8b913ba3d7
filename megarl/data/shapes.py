"""Coloured squares: questions about small pictures with exact answers, for vision-language policies.

    python -m megarl.data.shapes --out DIR [--train 2000] [--heldout 128] [--seed 0] [--size 64]

Each picture is `--size` x `--size` pixels: 1 to MAX_SQUARES solid squares of PALETTE colours on a plain
BACKGROUND, axis-aligned, none overlapping or touching another (GAP_PX of background between any two), written
as DIR/images/SPLIT_NNNNN.png. A row of DIR/train.jsonl or DIR/heldout.jsonl asks one of two QUESTIONS about its
picture:

    {"prompt": "How many squares are in the image?", "images": ["images/train_00000.png"], "answer": "3"}
    {"prompt": "What colour is the largest square?", "images": ["images/train_00001.png"], "answer": "blue"}

Image paths are relative to the data file. The largest square is unambiguous: its side is at least
LARGEST_MARGIN times every other square's. Every picture differs from every other, across both splits. Same
arguments, same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Colour words and their exact RGB values: far apart from each other and from the background.
PALETTE = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 50, 190),
}
BACKGROUND = (245, 245, 245)
QUESTIONS = {"count": "How many squares are in the image?", "largest": "What colour is the largest square?"}
MAX_SQUARES = 5
MIN_SIZE_PX = 32    # smaller pictures leave no room for MAX_SQUARES squares told apart by size
GAP_PX = 2          # background between two squares, so each is one connected region of its colour
LARGEST_MARGIN = 1.3  # the largest square's side over any other's, at least
PLACEMENT_TRIES = 200  # random positions tried for a square before the picture is drawn again


def draw_squares(rng: random.Random, size: int) -> list[tuple[int, int, int, str]]:
    """(top, left, side, colour) of each square of one picture, largest first: 1..MAX_SQUARES squares placed
    without overlap or contact, the first LARGEST_MARGIN times wider than any other."""
    while True:
        count = rng.randint(1, MAX_SQUARES)
        largest = rng.randint(size // 4, size * 3 // 8)
        smallest = max(3, size // 16)
        sides = [largest] + [rng.randint(smallest, int(largest / LARGEST_MARGIN)) for _ in range(count - 1)]
        squares: list[tuple[int, int, int, str]] = []
        for side in sides:
            for _ in range(PLACEMENT_TRIES):
                top, left = rng.randint(0, size - side), rng.randint(0, size - side)
                # apart by GAP_PX: the squares grown by GAP_PX on every side do not meet
                if all(top + side + GAP_PX <= t or t + s + GAP_PX <= top or left + side + GAP_PX <= l
                       or l + s + GAP_PX <= left for t, l, s, _ in squares):
                    squares.append((top, left, side, rng.choice(list(PALETTE))))
                    break
            else:
                break  # no room left: draw the picture again
        if len(squares) == count:
            return squares


def render(squares: list[tuple[int, int, int, str]], size: int):
    """The picture of `squares` as an RGB PIL image."""
    import numpy as np
    from PIL import Image

    pixels = np.empty((size, size, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    for top, left, side, colour in squares:
        pixels[top:top + side, left:left + side] = PALETTE[colour]
    return Image.fromarray(pixels)


def make_shapes_splits(out_dir: str | Path, *, seed: int = 0, train_size: int = 2000, heldout_size: int = 128,
                       size: int = 64) -> list[Path]:
    """Write images/*.png, train.jsonl and heldout.jsonl under `out_dir` and return the two data files' paths.
    Each row's question is one of QUESTIONS, drawn with even odds."""
    if size < MIN_SIZE_PX:
        raise ValueError(f"--size {size}: pictures must be at least {MIN_SIZE_PX} pixels a side")
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    seen: set[tuple] = set()
    paths = []
    for split, rows in (("train", train_size), ("heldout", heldout_size)):
        lines = []
        for i in range(rows):
            squares = draw_squares(rng, size)
            while tuple(squares) in seen:  # every picture once, across both splits
                squares = draw_squares(rng, size)
            seen.add(tuple(squares))
            image = f"images/{split}_{i:05d}.png"
            render(squares, size).save(out_dir / image, format="PNG")
            kind = rng.choice(list(QUESTIONS))
            answer = str(len(squares)) if kind == "count" else squares[0][3]
            lines.append(json.dumps({"prompt": QUESTIONS[kind], "images": [image], "answer": answer}) + "\n")
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(lines))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl, heldout.jsonl and images/")
    parser.add_argument("--train", type=int, default=2000, help="rows (and pictures) in train.jsonl")
    parser.add_argument("--heldout", type=int, default=128, help="rows (and pictures) in heldout.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pictures and the questions")
    parser.add_argument("--size", type=int, default=64, help=f"picture side in pixels (>= {MIN_SIZE_PX})")
    args = parser.parse_args(argv)
    try:
        paths = make_shapes_splits(args.out, seed=args.seed, train_size=args.train, heldout_size=args.heldout,
                                   size=args.size)
    except ValueError as e:
        parser.error(str(e))
    print("wrote " + ", ".join(str(p) for p in paths) + f" and their pictures in {Path(args.out) / 'images'}")


if __name__ == "__main__":
    main()
