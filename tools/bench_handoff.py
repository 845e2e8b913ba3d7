"""Weight-push throughput and peak extra memory, for a model shaped like Qwen2.5-0.5B.

    python tools/bench_handoff.py [--device cpu|cuda] [--engine sglang|native] [--bucket-mb 64]
                                  [--dtype bfloat16] [--repeats 5] [--threads 1] [--workdir DIR] [--json PATH]
                                  [--layers 24] [--vocab-size 151936] [--verify sampled] [--verify-period 4]

Writes a checkpoint with Qwen2.5-0.5B's config and tensor shapes (random values, nothing downloaded),
starts the rollout engine on it, and pushes a second copy of every tensor through megarl.handoff
(byte-bounded buckets; into SGLang: one byte buffer per bucket and a header, checked in each TP scheduler; over
shared memory on CPU, CUDA IPC on GPU).
The reference is a plain `copy_` of the same tensors into preallocated ones of the same shapes, timed in
the same run: the ratio says what the handoff costs over moving the bytes. Peak extra memory is this
process's growth during the last push (resident set size on CPU, sampled every 2 ms; the allocator's peak
on GPU), printed beside the bucket and the largest tensor (the contract: about one bucket plus the largest
tensor). The first push is shown too: an in-process engine whose weights are still memory-mapped from the
checkpoint grows by its whole model then. SGLang's scheduler is another process: its copy is not counted.

`--verify MODE` (rollout.verify_weights) then times what checking the pushes costs: one push that verifies
every tensor (a run's first push), then pushes checked by MODE alternating with unchecked ones, push by push,
so both see the same machine state; it prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megarl.handoff import WeightCheck, push_weights  # noqa: E402

# Qwen2.5-0.5B (config.json of the released checkpoint): 494M parameters, tied embeddings, GQA 14/2.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def hf_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes of a Qwen2 checkpoint with config `c`."""
    h, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    shapes = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                   (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                   (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (c["intermediate_size"], h)),
                   (p + "mlp.up_proj.weight", (c["intermediate_size"], h)),
                   (p + "mlp.down_proj.weight", (h, c["intermediate_size"]))]
    return shapes + [("model.norm.weight", (h,))]


def synthesize(config: dict, dtype: torch.dtype, device: str, *, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, (torch.randn(shape, generator=gen) * 0.02).to(dtype).to(device))
            for name, shape in hf_shapes(config)]


def write_checkpoint(out: Path, config: dict, dtype: str) -> Path:
    """config.json, tokenizer files and model.safetensors with the 0.5B shapes."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    sys.path.insert(0, str(REPO / "tools"))
    from make_tiny_model import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    Qwen2Config(**config, architectures=["Qwen2ForCausalLM"], bos_token_id=0, eos_token_id=0, pad_token_id=0, use_sliding_window=False,
                torch_dtype=dtype).save_pretrained(out)
    build_tokenizer().save_pretrained(out)  # not read (token ids in, token ids out); keeps loaders happy
    tensors = dict(synthesize(config, getattr(torch, dtype), "cpu", seed=0))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class PeakRSS:
    """Highest resident set size of this process while in the block, sampled every 2 ms."""

    def __init__(self):
        import psutil

        self._proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.start = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compare_verified(engine, tensors, *, bucket_bytes: int, mode: str, period: int, repeats: int, device: str,
                     version: int) -> dict:
    """Seconds of a push that verifies every tensor, and medians of `repeats` pushes checked by `mode` and of as
    many unchecked ones, alternating (unchecked first), each pair back to back; push versions from `version`."""
    check = WeightCheck(mode, period=period)
    stats = {}

    def push(verify, v):
        return timed(lambda: stats.update(push_weights(engine, iter(tensors), bucket_bytes=bucket_bytes,
                                                       version=v, verify=verify)), device)

    first_s = push(check.select(version), version)  # a run's first push: every tensor, in every mode but off
    plain, checked, verified = [], [], []
    for r in range(repeats):
        plain.append(push(lambda index: False, version + 1 + 2 * r))
        # the rotation as a run's consecutive pushes see it (the unchecked pushes take versions in between)
        checked.append(push(check.select(version + 1 + r), version + 2 + 2 * r))
        verified.append(stats["verified"])
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"verify": mode, "verify_period": period, "first_push_verified_s": first_s,
            "unverified_push_s": median(plain), "verified_push_s": median(checked),
            "verified_over_unverified": median(checked) / median(plain),
            "verified_tensors_per_push": sum(verified) / len(verified)}


def make_engine(kind: str, model_dir: Path, *, dtype: str, device: str):
    match kind:
        case "sglang":
            from megarl.rollout.sglang_engine import SGLangEngine
            from megarl.models.arch import read_shape

            return SGLangEngine(str(model_dir), shape=read_shape(str(model_dir)), dtype=dtype, seed=0, mem_fraction=0.3)
        case "native":
            from megarl.rollout.native import NativeEngine

            return NativeEngine(str(model_dir), dtype=dtype, seed=0, device=device)
    raise ValueError(f"--engine must be sglang or native, got {kind!r}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--engine", default="sglang", choices=["sglang", "native"])
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="handoff bucket size (rollout.bucket_bytes)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes and copies; the fastest counts")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: stable ratios on a shared machine; 0: torch's default)")
    parser.add_argument("--workdir", help="where the checkpoint is written (default: a temporary directory)")
    parser.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"],
                        help="fewer layers (and --vocab-size) make a smaller model of the same layer shapes")
    parser.add_argument("--vocab-size", type=int, default=QWEN25_05B["vocab_size"])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--verify", default="off", choices=["off", "first", "sampled", "every"],
                        help="also time pushes checked this way (rollout.verify_weights) against unchecked ones")
    parser.add_argument("--verify-period", type=int, default=4, help="rollout.verify_period of --verify sampled")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = QWEN25_05B | dict(num_hidden_layers=args.layers, vocab_size=args.vocab_size)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if (args.device == "cuda") != torch.cuda.is_available() and args.engine == "sglang":
        parser.error("the SGLang engine runs on the GPU whenever one is visible: use --device cuda there")

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        t0 = time.perf_counter()
        model_dir = write_checkpoint(Path(tmp) / "qwen2.5-0.5b-shaped", config, args.dtype)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine = make_engine(args.engine, model_dir, dtype=args.dtype, device=args.device)
        t_start = time.perf_counter() - t0
        try:
            dtype = getattr(torch, args.dtype)
            tensors = synthesize(config, dtype, args.device, seed=1)  # the trainer's copy: other values, same shapes
            total = sum(t.numel() * t.element_size() for _, t in tensors)
            largest_name, largest = max(((n, t.numel() * t.element_size()) for n, t in tensors), key=lambda x: x[1])
            bucket_bytes = int(args.bucket_mb * 2**20)

            targets = [torch.empty_like(t) for _, t in tensors]

            def plain_copy():
                for dst, (_, src) in zip(targets, tensors):
                    dst.copy_(src)

            copy_s = min(timed(plain_copy, args.device) for _ in range(args.repeats))
            targets.clear()  # free the copies before measuring the push
            if args.device == "cuda":
                torch.cuda.empty_cache()

            push_s, peaks, stats = [], [], {}
            for version in range(1, args.repeats + 1):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    push_s.append(timed(lambda: stats.update(push_weights(
                        engine, iter(tensors), bucket_bytes=bucket_bytes, version=version)), args.device))
                    peaks.append(torch.cuda.max_memory_allocated() - before)
                else:
                    with PeakRSS() as rss:
                        push_s.append(timed(lambda: stats.update(push_weights(
                            engine, iter(tensors), bucket_bytes=bucket_bytes, version=version)), args.device))
                    peaks.append(rss.peak - rss.start)
            verified = {}
            if args.verify != "off":
                verified = compare_verified(engine, tensors, bucket_bytes=bucket_bytes, mode=args.verify,
                                            period=args.verify_period, repeats=args.repeats, device=args.device,
                                            version=args.repeats + 1)
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()

    result = {
        "device": args.device, "engine": args.engine, "dtype": args.dtype,
        "params": sum(t.numel() for _, t in tensors), "bytes": total, "buckets": stats["buckets"],
        "bucket_bytes": bucket_bytes, "largest_tensor": largest_name, "largest_tensor_bytes": largest,
        "copy_gb_per_s": total / copy_s / 1e9, "push_gb_per_s": total / min(push_s) / 1e9,
        "push_over_copy": copy_s / min(push_s), "peak_extra_bytes": peaks[-1], "first_push_peak_extra_bytes": peaks[0],
        "checkpoint_write_s": t_write, "engine_start_s": t_start, **verified,
    }
    mib = 2**20
    print(f"model          Qwen2.5-0.5B shapes, {result['params'] / 1e6:.1f}M parameters, {total / 1e9:.2f} GB "
          f"({args.dtype}); largest tensor {largest_name} {largest / mib:.0f} MiB")
    print(f"engine         {args.engine} on {args.device} (started in {t_start:.0f} s); bucket {bucket_bytes / mib:.0f} MiB, "
          f"{stats['buckets']} buckets per push")
    print(f"plain copy     {result['copy_gb_per_s']:.2f} GB/s")
    print(f"push           {result['push_gb_per_s']:.2f} GB/s  (push / copy = {result['push_over_copy']:.3f})")
    print(f"peak extra     {peaks[-1] / mib:.0f} MiB  (bucket {bucket_bytes / mib:.0f} MiB + largest tensor "
          f"{largest / mib:.0f} MiB = {(bucket_bytes + largest) / mib:.0f} MiB); first push {peaks[0] / mib:.0f} MiB")
    if verified:
        print(f"verify         first push, every tensor checked: {verified['first_push_verified_s']:.3f} s; "
              f"{args.verify} (period {args.verify_period}, {verified['verified_tensors_per_push']:.0f} tensors "
              f"a push): {verified['verified_push_s']:.3f} s vs unchecked {verified['unverified_push_s']:.3f} s "
              f"(ratio {verified['verified_over_unverified']:.3f}, medians of {args.repeats} alternating pairs)")
    print("json", json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
