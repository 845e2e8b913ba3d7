"""RL step time with a slow reward scored after generation (in the trainer process, reward.workers: 0)
against scored while generation runs (on a Ray pool, reward.workers: N), in the same invocation.

    python tools/bench_reward_overlap.py                       # model and arithmetic data made first
    python tools/bench_reward_overlap.py --steps 6 --workers 2 --max-new-tokens 32

Each mode is one `python -m megarl train` of GRPO steps on the same model, data and seed, with the reward
`slow_exact_answer` below: the exact-answer reward after sleeping REWARD_S (a stand-in for a sandbox or a
remote verifier). With --workers 1 the pool scores one sample at a time, like the trainer process, so
the difference between the modes is the overlap alone (plus Ray's task overhead); more workers add
parallel scoring on top. The modes alternate --repeats times (load from other processes falls on both
alike); step 1 of each run is left out (Ray workers and caches start there). Printed: median step time,
generation and after-generation reward time, the share of samples scored before generation ended, the
ratio of step times, and whether both modes gave the same rewards (they must: same samples, same terms).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REWARD_S = 0.01  # what the reward takes per sample
# A model wide enough that generating takes about as long as scoring, so there is something to hide.
MODEL = dict(arch="qwen2", seed=0, hidden=256, layers=4, heads=8, kv_heads=4, ffn=512)


def slow_exact_answer(*, prompt, response, answer, metadata):
    """The exact-answer reward, after sleeping REWARD_S."""
    from megarl.rewards.exact import exact_answer_reward

    time.sleep(REWARD_S)
    return exact_answer_reward(response, answer)


def prepare(out: Path, *, shape: dict = MODEL) -> tuple[Path, Path]:
    """The model (random, of make_tiny_model arguments `shape`) and the arithmetic data under `out`, made once.
    Shared by tools/bench_async.py."""
    model, data = out / "model", out / "data"
    if not (model / "megarl_tiny.json").exists():
        spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        tool.make_tiny_model(model, **shape)
    if not (data / "train.jsonl").exists():
        subprocess.run([sys.executable, "-m", "megarl.data.arithmetic", "--out", str(data)], check=True, cwd=REPO)
    return model, data


def write_recipe(path: Path, *, model: Path, data: Path, args) -> Path:
    path.write_text(
        f"seed: 0\nmodel:\n  path: {model}\n"
        f"data:\n  train_path: {data / 'train.jsonl'}\n  prompts_per_step: {args.prompts}\n"
        f"rollout:\n  engine: native\n  n_samples: {args.n_samples}\n  max_new_tokens: {args.max_new_tokens}\n"
        "algo:\n  name: grpo\n  kl_coef: 0.0\n"
        f"train:\n  steps: {args.steps}\n  micro_batch_size: {args.prompts * args.n_samples}\n"
        "reward:\n  terms:\n    - {kind: custom, function: 'bench_reward_overlap:slow_exact_answer'}\n"
        "checkpoint:\n  save_final: false\n"
        "log:\n  progress: false\n")
    return path


def run_mode(recipe: Path, run_dir: Path, *, workers: int) -> list[dict]:
    """Metrics of each step of one training run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tools"),
                                                       os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "megarl", "train", str(recipe), f"run_dir={run_dir}",
                    f"reward.workers={workers}"], check=True, cwd=REPO, env=env)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_s(record: dict) -> float:
    return sum(v for k, v in record.items() if k.startswith("timing/") and k.endswith("_s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_reward_overlap")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="Ray workers of the overlapped mode")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is left out)")
    args.out.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.out)
    recipe = write_recipe(args.out / "recipe.yaml", model=model, data=data, args=args)
    modes = {"after generation (workers 0)": 0, f"overlapped (workers {args.workers})": args.workers}
    records: dict[str, list[dict]] = {name: [] for name in modes}
    rewards: dict[str, list[list[float]]] = {name: [] for name in modes}
    for repeat in range(args.repeats):
        for name, workers in modes.items():
            steps = run_mode(recipe, args.out / f"run_w{workers}_{repeat}", workers=workers)
            records[name] += steps[1:]
            rewards[name].append([r["reward/mean"] for r in steps])
    print(f"\n{args.prompts} prompts x {args.n_samples} samples, up to {args.max_new_tokens} new tokens, "
          f"reward {REWARD_S * 1000:g} ms per sample; medians over steps 2..{args.steps}, {args.repeats} run(s) each")
    medians = {}
    for name, steps in records.items():
        medians[name] = statistics.median(step_s(r) for r in steps)
        print(f"  {name:28s} step {medians[name]:.3f} s   generate "
              f"{statistics.median(r['timing/generate_s'] for r in steps):.3f} s   reward after generation "
              f"{statistics.median(r['timing/reward_s'] for r in steps):.3f} s   scored during generation "
              f"{statistics.mean(r['timing/reward_hidden_frac'] for r in steps):.0%}")
    off, on = medians.values()
    print(f"step time overlapped / after generation: {on / off:.3f}")
    same = all(a == b for a, b in zip(*rewards.values()))
    print(f"same rewards in both modes: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
