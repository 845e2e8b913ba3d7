"""Training throughput of one policy-loss step: megarl's Megatron engine against plain transformers, and
packed against padded micro-batches, measured in the same process on the same model and batch.

    python tools/bench_train.py --size small                  # makes a hidden-512, 8-layer model first
    python tools/bench_train.py --model /path/to/hf_dir --batch 16 --seq-len 1024
    python tools/bench_train.py --size 1b --batch 16 --seq-len 2048 --peak-tflops 790 --json out.json  # a GPU

Each step is timed `--reps` times after `--warmup` untimed ones, alternating with the step it is
compared with (so load from other processes falls on both alike); the median is reported. Throughput is real
(unpadded) tokens per second: the padded rows of a ragged batch count only their real tokens, so padding
shows up as lost throughput. Single process (TP = PP = DP = 1); fp32 on CPU, bf16 on GPU (both sides).

On a GPU it also reports the Megatron step's model FLOPs utilization against `--peak-tflops` (training FLOPs
per token 6 N + 12 L h T: N parameters, L layers, hidden h, sequence T; causal masking not discounted), and
its peak allocated memory (parameters, gradients, optimizer state and activations of one step, measured
after the transformers model is gone).

1. Megatron vs transformers on full-length rows (no padding): TrainEngine.train_step with the RL policy
   loss (`megarl.objective.PolicyObjective`, PPO clip, token mean) vs AutoModelForCausalLM forward, the same loss
   on the same logprobs, backward and a torch AdamW step, over the same micro-batches.
   Attention is torch's fused scaled_dot_product_attention on both sides on CPU (megarl's local-spec core
   attention, transformers' "sdpa" implementation); on GPU with Transformer Engine, megarl runs TE's.
2. Packed vs padded on a ragged batch (lengths uniform in [seq_len / 8, seq_len], as RL responses spread):
   train.micro_batch_tokens = micro_batch_size * seq_len against train.micro_batch_size.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.algo.aggregate import global_loss_norm  # noqa: E402
from megarl.config import AlgoConfig, OptimConfig  # noqa: E402
from megarl.objective import policy_objective  # noqa: E402

SIZES = {  # make_tiny_model arguments
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128),
    "small": dict(hidden=512, layers=8, heads=8, kv_heads=4, ffn=1408),
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632),  # 0.97B parameters (a 1.1B Llama's body)
}


def make_model(size: str, out: Path) -> Path:
    if (out / "megarl_tiny.json").exists():
        return out
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.make_tiny_model(out, arch="qwen2", seed=0, **SIZES[size])


def paired_medians(step_a, step_b, *, warmup: int, reps: int) -> tuple[float, float]:
    """Median seconds of two steps timed alternately (a, b, a, b, ...), so that load from other processes
    on the machine falls on both alike."""
    for _ in range(warmup):
        step_a()
        step_b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for step, out in ((step_a, times[0]), (step_b, times[1])):
            start = time.perf_counter()
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def batch_for(lengths: torch.Tensor, *, seq_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, dict]:
    """Tokens [B, T] right padded to `lengths`, and the policy loss's extras: a 16-token prompt, the rest a
    response, old logprobs near the model's, advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    cols = torch.arange(seq_len)[None]
    tokens = torch.randint(3, vocab, (batch, seq_len), generator=gen)
    tokens[cols >= lengths[:, None]] = 0
    mask = ((cols >= min(16, seq_len // 4)) & (cols < lengths[:, None])).float()
    extras = {"response_mask": mask, "old_logprobs": -3.0 * mask,
              "advantages": torch.linspace(-1.0, 1.0, batch)[:, None] * mask}
    return tokens, extras


def hf_step_fn(model_dir: str, tokens: torch.Tensor, extras: dict, *, micro_batch_size: int, loss_fn, lr: float,
               dtype: torch.dtype):
    """A plain transformers train step: forward, the same loss on the same logprobs, backward, AdamW."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    tokens = tokens.to(device)
    extras = {k: v.to(device) for k, v in extras.items()}

    def step():
        for i in range(0, len(tokens), micro_batch_size):
            ids = tokens[i: i + micro_batch_size]
            logits = model(ids).logits[:, :-1].float()
            logprobs = F.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
            loss, _ = loss_fn(logprobs, {k: v[i: i + micro_batch_size] for k, v in extras.items()})
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def gpu_figures(step, engine, *, params: int, tokens: int, seq_len: int, step_s: float,
                peak_tflops: float | None) -> dict:
    """Peak allocated bytes of one more Megatron step (the transformers model freed first), and the MFU of
    the timed step against `peak_tflops`."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    shape = engine.shape
    flops = (6 * params + 12 * shape.layers * shape.hidden * seq_len) * tokens
    out = dict(device=torch.cuda.get_device_name(), peak_allocated_bytes=peak, step_tflops=flops / step_s / 1e12)
    line = f"gpu          {out['device']}: {out['step_tflops']:.0f} TFLOP/s"
    if peak_tflops:
        out |= dict(peak_tflops=peak_tflops, mfu=out["step_tflops"] / peak_tflops)
        line += f" = {out['mfu']:.1%} MFU of {peak_tflops:.0f}"
    print(f"{line}; peak allocated {peak / 2**30:.2f} GiB")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF checkpoint directory (default: make one of --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model made by make_tiny_model")
    parser.add_argument("--work-dir", default="/tmp/megarl_bench", help="where --size models are made")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="T: the longest sequence")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: stable ratios on a shared machine; 0: torch's default)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for the MFU (GPU only)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape
    from megarl.engine.parallel import init_parallel

    model_dir = args.model or str(make_model(args.size, Path(args.work_dir) / f"qwen2_{args.size}"))
    groups = init_parallel(tp=1, pp=1, seed=0)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    optim = OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1.0, distributed=False)
    engine = TrainEngine(model_dir=model_dir, shape=read_shape(model_dir), dtype=dtype, megatron={}, groups=groups, optim=optim)
    params = sum(p.numel() for p in engine.module.parameters())
    vocab, mbs, seq_len = engine.shape.vocab_size, args.micro_batch_size, args.seq_len
    print(f"model {model_dir}: {params / 1e6:.1f}M parameters, batch {args.batch} x {seq_len}, micro-batch {mbs}, "
          f"{torch.get_num_threads()} threads, {dtype}, median of {args.reps} after {args.warmup} warmup")

    def megatron_step(tokens, extras, lengths=None, micro_batch_tokens=None):
        loss_fn = partial(policy_objective(AlgoConfig()), norm=global_loss_norm(extras["response_mask"]))
        return lambda: engine.train_step(tokens, extras, loss_fn, temperature=1.0, micro_batch_size=mbs,
                                         lengths=lengths, micro_batch_tokens=micro_batch_tokens)

    # 1. Megatron vs transformers, full rows
    full = torch.full((args.batch,), seq_len)
    tokens, extras = batch_for(full, seq_len=seq_len, vocab=vocab, seed=0)
    n_tokens = int(full.sum())
    loss_fn = partial(policy_objective(AlgoConfig()), norm=global_loss_norm(extras["response_mask"]))
    hf = hf_step_fn(model_dir, tokens, extras, micro_batch_size=mbs, loss_fn=loss_fn, lr=1e-6,
                    dtype=getattr(torch, dtype))
    t_megatron, t_hf = paired_medians(megatron_step(tokens, extras), hf, warmup=args.warmup, reps=args.reps)
    del hf
    print(f"full rows    megatron {n_tokens / t_megatron:10.0f} tok/s ({t_megatron:.3f} s)   "
          f"transformers {n_tokens / t_hf:10.0f} tok/s ({t_hf:.3f} s)   megatron/transformers {t_hf / t_megatron:.2f}x")
    result = dict(model_dir=model_dir, params=params, dtype=dtype, batch=args.batch, seq_len=seq_len,
                  micro_batch_size=mbs, megatron_step_s=t_megatron, transformers_step_s=t_hf,
                  megatron_tokens_per_s=n_tokens / t_megatron, transformers_tokens_per_s=n_tokens / t_hf)
    if torch.cuda.is_available():
        result |= gpu_figures(megatron_step(tokens, extras), engine, params=params, tokens=n_tokens,
                              seq_len=seq_len, step_s=t_megatron, peak_tflops=args.peak_tflops)

    # 2. packed vs padded, ragged lengths
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(2, seq_len // 8), seq_len + 1, (args.batch,), generator=gen)
    tokens, extras = batch_for(lengths, seq_len=seq_len, vocab=vocab, seed=2)
    real = int(lengths.sum())
    t_padded, t_packed = paired_medians(megatron_step(tokens, extras),
                                        megatron_step(tokens, extras, lengths, mbs * seq_len),
                                        warmup=args.warmup, reps=args.reps)
    print(f"ragged rows  ({real} real of {args.batch * seq_len} padded tokens)   padded {real / t_padded:10.0f} tok/s "
          f"({t_padded:.3f} s)   packed {real / t_packed:10.0f} tok/s ({t_packed:.3f} s)   "
          f"packed/padded {t_padded / t_packed:.2f}x")
    result |= dict(ragged_real_tokens=real, padded_step_s=t_padded, packed_step_s=t_packed)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
