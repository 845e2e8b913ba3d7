"""Check that the installed SGLang serves megarl's rollout-engine contract: what to run after upgrading SGLang.

    python tools/check_engine.py [--model DIR] [--dtype float32|bfloat16] [--timeout-s 5] [--json OUT]

Without --model it makes two tiny Qwen2 checkpoints of its own (tools/make_tiny_model.py) in a temporary
directory. Each check prints PASS, FAIL or SKIP (with why) and the figures behind it; the exit code is 1 when
any check fails. Checks, in order, on one engine started from the model:

  api        every SGLang call megarl makes takes the arguments megarl passes (signatures only)
  push       a push of other weights (the model's plus noise) loads, in several buckets, as version 1
  version    SGLang stamps the pushed version on every response (meta_info["weight_version"])
  verify     the push check compares every pushed tensor with the engine's copy (in each SGLang TP scheduler,
             as it arrived and where it was loaded: megarl.rollout.sglang_checks)
  parity     the engine's logprobs of its own samples equal transformers' on the pushed weights (the trainer
             computes the same function): fp32 within 1e-4, bf16 within 0.6 per token
  flush      flush_cache answers
  memory     release and resume of weights and KV cache, then a full push and generation (GPU only)
  routes     MoE routes come back for every token fed in (MoE models)
  timeout    with its processes stopped (SIGSTOP), generate fails within --timeout-s naming its phase
  restart    abandon kills the engine's processes; a new engine in the same process takes a push and generates

The trainer side (Megatron) is not needed: the weights are pushed from the checkpoint's own tensors.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS = [[21, 22, 15, 23, 25, 33], [30, 31, 15, 33], [24, 15, 24, 33, 4]]
PARITY_TOL = {"float32": 1e-4, "bfloat16": 0.6}  # bf16: 8 significant bits on logits of order 1-8
NOISE = 0.01  # what the push adds to every weight, so a push that does not land shows in the parity


class Report:
    """The checks' outcomes, printed as they come."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, name: str, status: str, detail: str = "", **figures) -> None:
        self.rows.append({"check": name, "status": status, "detail": detail, **figures})
        print(f"{status:4}  {name:8}  {detail}", flush=True)

    def run(self, name: str, check) -> None:
        """`check()` returns (status, detail, figures) or raises (FAIL with the error)."""
        try:
            status, detail, figures = check()
        except Exception as e:  # noqa: BLE001 - a check that raises fails, and the next runs
            status, detail, figures = "FAIL", f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()}
        self.add(name, status, detail, **figures)

    @property
    def failed(self) -> bool:
        return any(row["status"] == "FAIL" for row in self.rows)


def accepts(fn, *args, **kwargs) -> None:
    """`fn` (unbound: pass a placeholder for self) takes these arguments; raises TypeError otherwise."""
    inspect.signature(fn).bind(*args, **kwargs)


def api_check() -> tuple[str, str, dict]:
    """The SGLang calls of megarl.rollout.sglang_engine, bound to the arguments it passes."""
    import torch
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from megarl.config import LoraConfig
    from megarl.rollout.sglang_engine import CACHE_TAGS, WEIGHT_TAGS
    from megarl.rollout.sglang_launch import engine_args

    for on_gpu in (False, True):
        for capture_routes, lora in ((False, None), (True, None), (False, LoraConfig())):
            args = engine_args("model", on_gpu=on_gpu, dtype="bfloat16", seed=0, tp_size=1, mem_fraction=0.5,
                               base_gpu_id=0, capture_routes=capture_routes, lora=lora)
            accepts(ServerArgs, **args, custom_sigquit_handler=print)
            if args.get("enable_return_routed_experts", False) != capture_routes:
                return "FAIL", "engine_args: capture_routes does not set enable_return_routed_experts", {}
        # an engine over two whole nodes (rollout.tp a multiple of the GPUs of a node), node 1's part
        accepts(ServerArgs, **engine_args("model", on_gpu=on_gpu, dtype="bfloat16", seed=0, tp_size=16,
                                          mem_fraction=0.5, base_gpu_id=0, nnodes=2, node_rank=1,
                                          dist_init_addr="10.0.0.1:29600"), custom_sigquit_handler=print)
    accepts(SamplingParams, temperature=1.0, top_p=1.0, max_new_tokens=4, stop_token_ids=[0], ignore_eos=False)
    accepts(Engine.generate, None, input_ids=[[1]], sampling_params={}, return_logprob=True)
    accepts(Engine.async_generate, None, input_ids=[1], sampling_params={}, return_logprob=True,
            return_routed_experts=True, lora_path=None)
    accepts(Engine.load_lora_adapter_from_tensors, None, "policy-v1", {}, {})  # rollout.lora_sync: adapter
    accepts(Engine.unload_lora_adapter, None, "policy-v1")
    accepts(Engine.begin_weight_update, None)
    accepts(Engine.end_weight_update, None)
    accepts(Engine.update_weights_from_tensor, None, [b""], load_format="flattened_bucket", flush_cache=False)
    accepts(Engine.flush_cache, None)
    accepts(Engine.get_weights_by_name, None, "model.norm.weight", truncate_size=1)
    accepts(UpdateWeightVersionReqInput, new_version="1", abort_all_requests=False)
    accepts(TokenizerManager.update_weight_version, None, UpdateWeightVersionReqInput(new_version="1"))
    accepts(TokenizerManager.auto_create_handle_loop, None)
    accepts(Engine.release_memory_occupation, None, tags=["weights"])
    accepts(Engine.resume_memory_occupation, None, tags=["weights"])
    accepts(Engine.get_all_child_pids, None)
    accepts(Engine.shutdown, None)
    if set(WEIGHT_TAGS + CACHE_TAGS) != set(GPU_MEMORY_ALL_TYPES):
        return "FAIL", f"memory tags {WEIGHT_TAGS + CACHE_TAGS} are not SGLang's {sorted(GPU_MEMORY_ALL_TYPES)}", {}
    accepts(FlattenedTensorBucket, named_tensors=[])
    accepts(MultiprocessingSerializer.serialize, {})
    accepts(monkey_patch_torch_reductions)
    accepts(torch.cuda.memory._set_allocator_settings, "expandable_segments:False")
    accepts(torch.cuda.ipc_collect)
    return "PASS", "every call megarl makes binds its arguments", {}


def tiny_models(root: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.make_tiny_model(root / "model", arch="qwen2", seed=0, init_std=0.2)


def reference_logprobs(model, tokens, *, temperature: float):
    """Token logprobs [B, T] of a transformers model (column 0 is 0)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def pushed_reference(model_dir: Path, pushed: dict, *, dtype):
    """transformers' model of `model_dir` holding the `pushed` tensors (checkpoint names), loaded from a copy of
    the checkpoint with them as its weights: transformers maps checkpoint names to its modules as it loads (it
    stacks MoE experts into one tensor per layer), so a state dict of checkpoint names would miss them."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        for path in Path(model_dir).iterdir():  # config, tokenizer and generation files: all but the weights
            if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".safetensors.index.json"):
                shutil.copy(path, tmp)
        save_file({name: t.contiguous() for name, t in pushed.items()}, str(Path(tmp) / "model.safetensors"))
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()


def check_engine(model_dir: Path, *, dtype: str, timeout_s: float, report: Report) -> None:
    import psutil
    import torch
    from safetensors.torch import load_file

    from megarl.batch import pack_sequences
    from megarl.device import on_gpu
    from megarl.handoff import push_weights
    from megarl.models.arch import read_shape
    from megarl.rollout.engine import EngineError
    from megarl.rollout.sglang_engine import SGLangEngine

    report.run("api", api_check)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    pushed = {name: (t.float() + NOISE * torch.randn(t.shape, generator=generator)).to(torch_dtype)
              for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    reference = pushed_reference(model_dir, pushed, dtype=torch_dtype)
    eos = int(reference.config.eos_token_id if isinstance(reference.config.eos_token_id, int)
              else reference.config.eos_token_id[0])
    sample = dict(temperature=0.7, top_p=1.0, max_new_tokens=8, eos_id=eos, pad_id=0)
    moe = read_shape(str(model_dir)).is_moe
    engine = SGLangEngine(str(model_dir), shape=read_shape(str(model_dir)), dtype=dtype, seed=0, timeout_s=max(timeout_s, 300.0),
                          capture_routes=moe)
    engine.generate(PROMPTS, **sample)  # the first call is slow on a busy CPU; the timeout check shortens it
    state: dict = {}

    def push():
        stats = push_weights(engine, iter(pushed.items()), bucket_bytes=max(sum(
            t.numel() * t.element_size() for t in pushed.values()) // 3, 1), version=1, verify=lambda i: True,
            dtype=torch_dtype, engine_name="the engine under check")
        state["stats"] = stats
        if engine.weight_version != 1:
            return "FAIL", f"weight_version is {engine.weight_version} after the push of version 1", {}
        return "PASS", f"{stats['tensors']} tensors in {stats['buckets']} buckets", {"buckets": stats["buckets"],
                                                                            "tensors": stats["tensors"]}

    def version():
        gen = engine.generate(PROMPTS * 4, **sample)
        state["gen"] = gen
        stamped = sorted({v for versions in gen.versions for v in versions})
        if not engine.stamps_versions:
            return "SKIP", "this SGLang records no weight version (before 0.5.21): megarl counts its own", {}
        return ("PASS" if stamped == [1] else "FAIL"), f"stamped versions {stamped}", {"stamped": stamped}

    def verify():
        verified = state["stats"]["verified"]
        if verified < len(pushed):
            return "FAIL", f"{verified} of {len(pushed)} pushed tensors checked in the engine", {"verified": verified}
        return "PASS", f"{verified} checks of the {len(pushed)} pushed tensors equal", {"verified": verified}

    def parity():
        gen = state["gen"]
        tokens, mask, lp = pack_sequences(PROMPTS * 4, gen.response_ids, gen.logprobs, pad_id=0)
        diff = float(((lp - reference_logprobs(reference, tokens, temperature=0.7)) * mask).abs().max())
        ok = diff <= PARITY_TOL[dtype]
        return ("PASS" if ok else "FAIL"), f"max |engine - transformers| logprob {diff:.3g} (tolerance " \
                                           f"{PARITY_TOL[dtype]:g})", {"max_diff": diff}

    def flush():
        engine.flush_cache()
        return "PASS", "flush_cache answered", {}

    def memory():
        if not engine.on_gpu:
            return "SKIP", "release and resume are GPU-only", {}
        engine.release_memory()
        engine.resume_weights()
        push_weights(engine, iter(pushed.items()), bucket_bytes=1 << 26, version=2)
        engine.resume_cache()
        gen = engine.generate(PROMPTS, **sample)
        return "PASS", f"released, resumed, pushed again and generated {len(gen.response_ids)} responses", {}

    def routes():
        if not moe:
            return "SKIP", "a dense model has no routes", {}
        gen = engine.generate(PROMPTS, **sample)
        rows = [r.shape[0] for r in gen.routes]
        want = [len(p) + len(ids) - 1 for p, ids in zip(PROMPTS, gen.response_ids)]
        return ("PASS" if rows == want else "FAIL"), f"route rows {rows}, tokens fed in {want}", {}

    def timeout():
        children = engine.engine.get_all_child_pids()
        state["children"] = children
        engine.timeout_s = timeout_s
        for pid in children:
            os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            engine.generate(PROMPTS, **sample)
        except EngineError as e:
            elapsed = time.monotonic() - start
            ok = e.phase == "generate" and timeout_s <= elapsed < timeout_s + 30
            return ("PASS" if ok else "FAIL"), f"{e} (in {elapsed:.1f} s)", {"elapsed_s": elapsed}
        return "FAIL", "generate answered with the engine's processes stopped", {}

    def restart():
        engine.abandon()
        alive = [pid for pid in state.get("children", []) if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if alive:
            return "FAIL", f"processes {alive} outlived abandon", {}
        again = SGLangEngine(str(model_dir), shape=read_shape(str(model_dir)), dtype=dtype, seed=1)
        try:
            push_weights(again, iter(pushed.items()), bucket_bytes=1 << 26, version=5)
            gen = again.generate(PROMPTS, **sample)
            stamped = sorted({v for versions in gen.versions for v in versions})
        finally:
            again.shutdown()
        return ("PASS" if stamped == [5] else "FAIL"), f"a new engine took version 5 and generated {stamped}", {}

    for name, check in (("push", push), ("version", version), ("verify", verify), ("parity", parity),
                        ("flush", flush), ("memory", memory), ("routes", routes), ("timeout", timeout),
                        ("restart", restart)):
        if name in ("version", "verify") and "stats" not in state or name == "parity" and "gen" not in state:
            report.add(name, "FAIL", "not run: the push failed")
            continue
        report.run(name, check)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an HF checkpoint (default: a tiny Qwen2 made here)")
    parser.add_argument("--dtype", default="float32", choices=sorted(PARITY_TOL))
    parser.add_argument("--timeout-s", type=float, default=5.0, help="the timeout check's engine_timeout_s")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    if not math.isfinite(args.timeout_s) or args.timeout_s <= 0:
        parser.error("--timeout-s must be a positive number")
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_models(Path(tmp))
        check_engine(Path(model), dtype=args.dtype, timeout_s=args.timeout_s, report=report)
    if args.json:
        args.json.write_text(json.dumps(report.rows, indent=1))
    print("engine check:", "FAILED" if report.failed else "passed", flush=True)
    sys.exit(1 if report.failed else 0)


if __name__ == "__main__":
    main()
