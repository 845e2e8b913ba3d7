"""Two-digit multiplication for the calculator-tool recipe: prompts, and demonstrations for its warm start.

    python -m megarl.data.multiplication --out DIR [--seed 0] [--heldout-size 256] [--tool-frac 0.5]

writes DIR/train.jsonl and DIR/heldout.jsonl, {"prompt": "47*86=", "answer": "4042"}, and DIR/demos.jsonl, the
train problems once more as chat conversations for supervised warm starts. Operands are in [32, 99], so every
product has exactly four digits. A two-layer model of a few hundred thousand parameters does not learn to
multiply from a few thousand examples, but it does learn to copy: to put the problem into a calculator call
and the calculator's result into its answer. So the reward is within reach only through the tool.

A fraction `--tool-frac` of the demonstrations use the tool,

    user: 47*86=   assistant: <tool_call>{"name":"calculator","arguments":{"expression":"47*86"}}</tool_call>
    tool: 4042     assistant: 4042

and the others answer at once (assistant: 4042). A warm-started policy then calls the tool on about that
fraction of problems and guesses on the rest; RL is what makes it use the tool. Half by default: with fewer
copying examples (0.3) the copying skill forms within the warm start's 400 steps on some CPUs and not on
others, whose warm starts then leave RL nothing to copy with. As in
megarl.data.arithmetic, a problem is held out together with its mirror image (47*86 with 86*47).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LOW, HIGH = 32, 99  # operand range: 32 * 32 = 1024 and 99 * 99 = 9801, four digits each


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator, in the Qwen tool-call syntax (compact JSON)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def demonstration(a: int, b: int, *, use_tool: bool) -> list[dict]:
    prompt, answer = f"{a}*{b}=", str(a * b)
    if not use_tool:
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": tool_call_text(f"{a}*{b}")},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]


def write_multiplication_set(out_dir: str | Path, *, seed: int = 0, heldout_size: int = 256,
                             tool_frac: float = 0.5) -> Path:
    """Write train.jsonl, heldout.jsonl and demos.jsonl under `out_dir` and return it. Same arguments, same
    bytes."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(a, HIGH + 1)]
    rng.shuffle(pairs)
    heldout, train = [], []
    for a, b in pairs:
        split = heldout if len(heldout) < heldout_size else train
        split.extend([(a, b)] if a == b else [(a, b), (b, a)])
    rng.shuffle(train)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, problems in (("train", train), ("heldout", heldout[:heldout_size])):
        (out / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{a}*{b}=", "answer": str(a * b)}) + "\n" for a, b in problems))
    (out / "demos.jsonl").write_text("".join(
        json.dumps({"messages": demonstration(a, b, use_tool=rng.random() < tool_frac)}) + "\n" for a, b in train))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl, heldout.jsonl, demos.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-size", type=int, default=256, help="rows in heldout.jsonl")
    parser.add_argument("--tool-frac", type=float, default=0.5, help="fraction of demonstrations using the tool")
    args = parser.parse_args(argv)
    out = write_multiplication_set(args.out, seed=args.seed, heldout_size=args.heldout_size, tool_frac=args.tool_frac)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
