"""Steps per second of asynchronous split placement against the synchronous colocated loop, on the same ranks.

    python tools/bench_async.py [--nproc 2] [--steps 8] [--repeats 3] [--reward-sleep 0] [--reward-workers 0]
                                [--max-new-tokens 96] [--max-staleness 1] [--workdir DIR] [--json PATH]

Both runs are `megarl train` under torchrun with --nproc processes of one thread each, on a tiny Qwen2 made here
(tools/make_tiny_model.py) and the arithmetic prompts, GRPO, the same batch and steps. By default generations are
long (96 new tokens): a tiny model's decode step costs about the same whatever the batch, as a large model's
memory-bound decode does on a GPU, so more engines barely shorten it while training time follows the samples.
The reward can be slow too: a custom reward that sleeps --reward-sleep seconds per sample before scoring the
answer, as a sandboxed test run or a remote judge does; scored in the generating process after its round
(--reward-workers 0) or on a Ray pool of that many workers while the round generates (reward.workers).
- colocated: every rank trains and generates (one engine per rank), in turns;
- split: the last rank generates (placement.rollout_ranks=1) while the others train, up to --max-staleness
  versions ahead.
The runs alternate (colocated, split, colocated, ...) so load swings of the machine hit both. A run's step time
is the median over its steps after the first two of the sum of its phase timings (timing/*_s), which is the
step's wall time as the training rank 0 sees it; the ratio is colocated step time / split step time (> 1: split is
faster), printed for every pair with the median over pairs, beside split's median waits: the trainer's for generation
(async/rollout_wait_s + async/push_wait_s) and the engines' for the trainer (async/train_wait_s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SLOW_REWARD = '''import time


def score(*, prompt, response, answer, metadata):
    time.sleep({sleep})
    return float(answer.strip() in response)
'''


def prepare(work: Path, *, sleep: float) -> None:
    """The tiny model (make_tiny_model's default shape) and the data, as the reward-overlap bench makes them,
    and the slow reward's module."""
    sys.path.insert(0, str(REPO / "tools"))
    from bench_reward_overlap import prepare as model_and_data

    model_and_data(work, shape=dict(arch="qwen2", seed=0))
    (work / "slow_reward.py").write_text(SLOW_REWARD.format(sleep=sleep))


def recipe(work: Path, *, steps: int, max_new_tokens: int, nproc: int, reward_workers: int) -> Path:
    path = work / "recipe.yaml"
    path.write_text(
        f"model:\n  path: {work / 'model'}\n"
        f"data:\n  train_path: {work / 'data' / 'train.jsonl'}\n  prompts_per_step: {4 * nproc}\n"
        f"rollout:\n  n_samples: 4\n  max_new_tokens: {max_new_tokens}\n"
        f"train:\n  steps: {steps}\n  micro_batch_size: 8\n"
        "algo:\n  name: grpo\n"
        "optim:\n  lr: 1.0e-3\n"
        f"reward:\n  workers: {reward_workers}\n  terms:\n    - {{kind: custom, function: 'slow_reward:score'}}\n"
        "checkpoint:\n  every_steps: 0\n  save_final: false\n"
        "log:\n  progress: false\n")
    return path


def step_seconds(run_dir: Path) -> tuple[float, float, float]:
    """Median step seconds after the first two steps, and the median async waits (0 for colocated)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    phases = [sum(v for k, v in r.items() if k.startswith("timing/") and k.endswith("_s")
                  and k != "timing/startup_seconds") for r in records]
    return (statistics.median(phases),
            statistics.median(r.get("async/rollout_wait_s", 0.0) + r.get("async/push_wait_s", 0.0) for r in records),
            statistics.median(r.get("async/train_wait_s", 0.0) for r in records))


def one_run(work: Path, name: str, nproc: int, *overrides: str) -> tuple[float, float, float]:
    run_dir = work / name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(work), str(REPO)]))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={nproc}", "-m", "megarl", "train", str(work / "recipe.yaml"),
                             f"run_dir={run_dir}", "checkpoint.resume=never", *overrides],
                            env=env, capture_output=True, text=True, cwd=work)
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    seconds = step_seconds(run_dir)
    shutil.rmtree(run_dir)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reward-sleep", type=float, default=0.0)
    parser.add_argument("--reward-workers", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="megarl_bench_async_"))
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, sleep=args.reward_sleep)
    recipe(work, steps=args.steps, max_new_tokens=args.max_new_tokens, nproc=args.nproc,
           reward_workers=args.reward_workers)
    split = ("placement.mode=split", f"placement.rollout_ranks={args.nproc // 2}",
             f"algo.max_staleness={args.max_staleness}")
    pairs = []
    for n in range(args.repeats):
        colocated, _, _ = one_run(work, "colocated", args.nproc)
        asynchronous, rollout_wait, train_wait = one_run(work, "split", args.nproc, *split)
        pairs.append({"colocated_step_s": colocated, "split_step_s": asynchronous, "ratio": colocated / asynchronous,
                      "split_rollout_wait_s": rollout_wait, "split_train_wait_s": train_wait})
        print(f"pair {n + 1}: colocated {colocated:.3f} s/step, split {asynchronous:.3f} s/step "
              f"(trainer waited {rollout_wait:.3f} s for generation, engines {train_wait:.3f} s for the trainer), "
              f"ratio {colocated / asynchronous:.2f}x", flush=True)
    ratio = statistics.median(p["ratio"] for p in pairs)
    print(f"split (max_staleness {args.max_staleness}) / colocated steps per second, median of {args.repeats}: "
          f"{ratio:.2f}x  ({args.nproc} processes, reward sleep {args.reward_sleep} s per sample, "
          f"{args.reward_workers} reward workers, {args.max_new_tokens} new tokens)")
    if args.json:
        args.json.write_text(json.dumps({"pairs": pairs, "median_ratio": ratio, "args": {
            k: str(v) for k, v in vars(args).items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
