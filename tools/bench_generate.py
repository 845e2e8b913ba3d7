"""The native engine's generation against a baseline of itself, on a tiny Qwen2 made here.

    python tools/bench_generate.py [--baseline transformers|autograd] [--hidden 128] [--layers 2]
                                   [--prompts 32] [--samples 1] [--new-tokens 8] [--repeats 7]

Baselines: `transformers` runs every decode step through transformers' forward instead of the lean decode
steps (megarl.rollout.decode); `autograd` is the whole generation recording an autograd graph, as it ran
before inference mode. `--samples N` repeats each prompt N times (a GRPO group); both sides read a repeated
prompt once.

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
    parser.add_argument("--baseline", choices=["transformers", "autograd"], default="transformers")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", arch="qwen2", seed=0, hidden=args.hidden, layers=args.layers,
                                heads=8, kv_heads=4, ffn=2 * args.hidden)
        megarl = NativeEngine(str(model), seed=0, device="cpu")
        baseline = NativeEngine(str(model), seed=0, device="cpu", lean_decode=args.baseline != "transformers")
        prompts = [[5 + i % 7, 6, 7 + i % 3, 8 + i % 5] for i in range(args.prompts) for _ in range(args.samples)]
        kwargs = dict(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, eos_id=-1, pad_id=0)

        def run_baseline():
            if args.baseline == "transformers":
                return baseline.generate(prompts, **kwargs)
            with torch.enable_grad():
                return NativeEngine.generate.__wrapped__(baseline, prompts, **kwargs)

        times: dict[str, list[float]] = {"megarl": [], args.baseline: []}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            began = time.perf_counter()
            a = megarl.generate(prompts, **kwargs)
            times["megarl"].append(time.perf_counter() - began)
            began = time.perf_counter()
            b = run_baseline()
            times[args.baseline].append(time.perf_counter() - began)
            if a.response_ids != b.response_ids:
                raise SystemExit("the two sides sampled different tokens")
    medians = {side: statistics.median(t[1:]) for side, t in times.items()}
    for side, seconds in medians.items():
        print(f"{side:>13}: {seconds * 1000:8.1f} ms per generate ({len(prompts)} rows x {args.new_tokens} tokens)")
    print(f"speed-up over {args.baseline}: {medians[args.baseline] / medians['megarl']:.2f}x")


if __name__ == "__main__":
    main()
