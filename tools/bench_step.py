"""A whole GRPO step of megarl against a minimal GRPO step written with plain PyTorch and transformers, on the
same model, task, batch and threads.

    python tools/bench_step.py                      # tiny Qwen2 (hidden 128, 2 layers), 8 prompts x 4 x 8 tokens
    python tools/bench_step.py --shape small        # 4 layers, hidden 512
    python tools/bench_step.py --runs 3 --steps 8 --threads 1

megarl's step is `megarl.loops.rl.rl_step` on the quickstart recipe (native engine, real Megatron-core, one
process): generate, reward, logprobs, advantages, train, weight push, metrics. The plain step is what a
from-scratch GRPO trainer does with transformers: `model.generate` (sampling), the same exact-answer reward,
group-normalized advantages, one forward and backward of the PPO-clip loss on the sampled tokens (the first
epoch is on-policy, so the old logprobs are the forward's own, detached), gradient clipping and a torch
AdamW step. Both start from the same checkpoint, use the same optimizer settings, and draw prompts from the
same arithmetic task.

The two steps alternate (megarl, plain, megarl, ...), so load from other processes falls on both alike;
each run drops its first step of each side (warm-up) and reports the median of the rest. With `--runs`
N the whole comparison is repeated with fresh models and the median of the N ratios is printed last.
Per-phase times are megarl's own `timing/*` metrics and, for the plain step, generate / reward / train
(wall clock both). `--clock cpu` times whole steps by the process's CPU time instead of the wall clock.

megarl trains only on the samples with a non-zero advantage (`train.skip_zero_advantage`,
docs/algorithms.md); the plain step trains on all of them, and the share megarl trained on is printed. A new random
model earns no reward, so every group is all wrong and megarl trains on one sample: the ratio is then that of
the easiest case. For the ratio of a real run's mix, start both from a model that earns some reward
(`--model runs/quickstart/run/warmup`, the quickstart's warm start); `--set train.skip_zero_advantage=false`
times megarl's training on every sample.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

SHAPES = {  # make_tiny_model arguments
    "tiny": dict(hidden=128, layers=2, heads=8, kv_heads=4, ffn=256),   # the quickstart's model
    "small": dict(hidden=512, layers=4, heads=8, kv_heads=4, ffn=1408),
}


def make_inputs(out: Path, shape: str, model: Path | None = None) -> tuple[Path, Path]:
    """The model (made here, seed 0, unless `model` is given) and the arithmetic prompts, made here."""
    from make_tiny_model import make_tiny_model

    from megarl.data.arithmetic import make_arithmetic_splits

    if model is None:
        model = make_tiny_model(out / "model", arch="qwen2", seed=0, **SHAPES[shape])
    data = out / "data"
    make_arithmetic_splits(data, seed=0)
    return Path(model), data / "train.jsonl"


class MegarlStep:
    """megarl's RL step on the quickstart recipe, built once (one process, gloo)."""

    def __init__(self, model: Path, train: Path, run_dir: Path, *, prompts: int, samples: int, new_tokens: int,
                 overrides: list[str] = ()):
        from transformers import AutoTokenizer

        from megarl.config import load_config
        from megarl.data.prompts import load_prompts
        from megarl.loops.launch import launch
        from megarl.loops.colocated import ColocatedRollouts
        from megarl.loops.rl import rl_step
        from megarl.loops.rl_run import build_run
        from megarl.metrics import PhaseTimer

        cfg = load_config(REPO / "recipes" / "quickstart.yaml", [
            f"run_dir={run_dir}", f"model.path={model}", f"data.train_path={train}", "data.eval_path=null",
            "warmup.sft_steps=0", f"data.prompts_per_step={prompts}", f"rollout.n_samples={samples}",
            f"rollout.max_new_tokens={new_tokens}", f"train.micro_batch_size={prompts * samples}",
            "log.progress=false", *overrides])
        job, groups = launch(cfg)
        rows = load_prompts(cfg.data.train_path, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key)
        self.run = build_run(job, groups, rollouts=ColocatedRollouts(job, groups),
                             tokenizer=AutoTokenizer.from_pretrained(model), train_rows=rows, eval_rows=[])
        self.run.rollouts.hand_over(self.run, PhaseTimer())
        self._step, self.steps, self.trained_frac = rl_step, 0, 1.0

    def __call__(self) -> dict[str, float]:
        self.steps += 1
        metrics = self._step(self.run, self.steps)
        self.trained_frac = metrics["train/trained_frac"]
        return {k.removeprefix("timing/").removesuffix("_s"): v for k, v in metrics.items()
                if k.startswith("timing/") and k.endswith("_s")}


class PlainStep:
    """A minimal GRPO step with transformers and torch only."""

    def __init__(self, model: Path, train: Path, *, prompts: int, samples: int, new_tokens: int, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, grad_clip: float, clip: float,
                 seed: int = 0):
        import json

        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.tokenizer.padding_side = "left"
        self.rows = [json.loads(line) for line in train.read_text().splitlines() if line.strip()]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        self.prompts, self.samples, self.new_tokens = prompts, samples, new_tokens
        self.grad_clip, self.clip = grad_clip, clip
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0

    def __call__(self) -> dict[str, float]:
        from megarl.rewards.exact import exact_answer_reward

        times: dict[str, float] = {}
        began = time.perf_counter()
        pick = torch.randint(len(self.rows), (self.prompts,), generator=self.generator).tolist()
        rows = [self.rows[i] for i in pick for _ in range(self.samples)]
        enc = self.tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
        self.model.eval()
        with torch.no_grad():
            seqs = self.model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                       max_new_tokens=self.new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                                       eos_token_id=self.tokenizer.eos_token_id)
        now = time.perf_counter()
        times["generate"], began = now - began, now
        width = enc["input_ids"].shape[1]
        responses = seqs[:, width:]
        # the response's tokens up to and including its first EOS
        is_eos = responses == self.tokenizer.eos_token_id
        after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0
        response_mask = (~after_eos).float()
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        rewards = torch.tensor([exact_answer_reward(t, r["answer"]) for t, r in zip(texts, rows)])
        grouped = rewards.view(self.prompts, self.samples)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        now = time.perf_counter()
        times["reward"], began = now - began, now
        self.model.train()
        attention = torch.cat([enc["attention_mask"], response_mask.long()], dim=1)
        logits = self.model(input_ids=seqs, attention_mask=attention).logits[:, width - 1: -1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, responses[..., None]).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())
        adv = advantages[:, None]
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
        loss = (per_token * response_mask).sum() / response_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        times["train"] = time.perf_counter() - began
        self.steps += 1
        return times


def compare(args, tmp: Path) -> tuple[float, dict[str, float], dict[str, dict[str, list[float]]], float]:
    """One run: both steps alternately, `args.steps` timed steps each after one warm-up step. Returns the
    throughput ratio (plain seconds / megarl seconds, medians), each side's median step, each side's phase
    times per step, and the mean share of samples megarl trained on in the timed steps."""
    from megarl.config import load_config

    model, train = make_inputs(tmp, args.shape, args.model)
    sizes = dict(prompts=args.prompts, samples=args.samples, new_tokens=args.new_tokens)
    megarl = MegarlStep(model, train, tmp / "run", overrides=args.set, **sizes)
    optim = load_config(REPO / "recipes" / "quickstart.yaml", check_paths=False).optim
    algo = megarl.run.cfg.algo
    plain = PlainStep(model, train, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                      weight_decay=optim.weight_decay, grad_clip=optim.grad_clip, clip=algo.clip_low, **sizes)
    seconds: dict[str, list[float]] = {"megarl": [], "plain": []}
    trained: list[float] = []
    phases: dict[str, dict[str, list[float]]] = {"megarl": {}, "plain": {}}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for i in range(args.steps + 1):
        for side, step in (("megarl", megarl), ("plain", plain)):
            began = clock()
            parts = step()
            took = clock() - began
            if i == 0:
                continue
            seconds[side].append(took)
            if side == "megarl":
                trained.append(megarl.trained_frac)
            for name, value in parts.items():
                phases[side].setdefault(name, []).append(value)
    ratio = statistics.median(seconds["plain"]) / statistics.median(seconds["megarl"])
    return ratio, {s: statistics.median(v) for s, v in seconds.items()}, phases, statistics.mean(trained)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each side per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time steps by the wall clock, or by this process's CPU time (on a machine busy with "
                             "other work, closer to what each step costs; the phases stay wall times)")
    parser.add_argument("--model", type=Path, help="a checkpoint to start both from instead of a new random model "
                        "of --shape, e.g. the quickstart's warm start runs/quickstart/run/warmup: a model that earns "
                        "some reward, so its groups have mixed rewards as in a real run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for megarl's step (repeatable), e.g. train.skip_zero_advantage=false")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    ratios = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            ratio, medians, phases, trained = compare(args, Path(tmp))
        ratios.append(ratio)
        print(f"run {run + 1}: megarl {medians['megarl'] * 1000:7.1f} ms/step, plain {medians['plain'] * 1000:7.1f} "
              f"ms/step, throughput ratio {ratio:.2f}x")
        for side in ("megarl", "plain"):
            parts = ", ".join(f"{name} {statistics.median(v) * 1000:.1f}" for name, v in phases[side].items()
                              if statistics.median(v) >= 5e-4)
            print(f"    {side:>6} phases (ms, median): {parts}")
        print(f"    megarl trained on {trained:.0%} of the samples (non-zero advantage; the plain "
              "step trains on all)")
        reset_distributed()
    print(f"shape {args.shape}, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), {args.clock} clock: megarl / plain throughput, median of {args.runs} runs: "
          f"{statistics.median(ratios):.2f}x  (runs: {', '.join(f'{r:.2f}' for r in ratios)})")


def reset_distributed() -> None:
    """End the one-process world and Megatron's parallel state, so the next run builds its own."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
