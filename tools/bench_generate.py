"""Native-engine generation under inference mode (what the engine does) against the same generation with
autograd recording a graph (what it did before), on a tiny Qwen2 made here.

    python tools/bench_generate.py [--hidden 128] [--layers 2] [--prompts 32] [--new-tokens 8] [--repeats 7]

One thread; the two run alternately, step by step, from engines seeded alike, so both sample the same tokens
(checked) and load swings hit both. Prints each side's median seconds per generate call and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from make_tiny_model import make_tiny_model  # noqa: E402

from megarl.rollout.native import NativeEngine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", arch="qwen2", seed=0, hidden=args.hidden, layers=args.layers,
                                heads=8, kv_heads=4, ffn=2 * args.hidden)
        fast, slow = (NativeEngine(str(model), seed=0, device="cpu") for _ in range(2))
        prompts = [[5 + i % 7, 6, 7 + i % 3] for i in range(args.prompts)]
        kwargs = dict(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, eos_id=-1, pad_id=0)
        times: dict[str, list[float]] = {"inference_mode": [], "autograd": []}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            began = time.perf_counter()
            a = fast.generate(prompts, **kwargs)
            times["inference_mode"].append(time.perf_counter() - began)
            began = time.perf_counter()
            with torch.enable_grad():
                b = NativeEngine.generate.__wrapped__(slow, prompts, **kwargs)
            times["autograd"].append(time.perf_counter() - began)
            if a.response_ids != b.response_ids:
                raise SystemExit("the two sides sampled different tokens")
    medians = {side: statistics.median(t[1:]) for side, t in times.items()}
    for side, seconds in medians.items():
        print(f"{side:>15}: {seconds * 1000:8.1f} ms per generate ({args.prompts} prompts x {args.new_tokens} tokens)")
    print(f"speed-up of inference mode: {medians['autograd'] / medians['inference_mode']:.2f}x")


if __name__ == "__main__":
    main()
