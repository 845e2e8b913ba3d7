"""Run in a subprocess by test_sglang.py: the real SGLang engine against the Megatron trainer.

A scheduler exception in SGLang kills the whole process tree, so each check runs here and writes its
numbers to --out as JSON; the test reads and asserts them.

    sglang_worker.py cpu --trainer-model A --other-model B --eos-model C --out R.json
    sglang_worker.py gpu --trainer-model A --other-model B --out R.json      (one CUDA device)
    sglang_worker.py readback --trainer-model LLAMA --out R.json          (a model SGLang can read back)
    sglang_worker.py lora --trainer-model A --out R.json                  (adapters pushed alone)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import warnings

import torch

warnings.filterwarnings("ignore")

from megarl.batch import pack_sequences  # noqa: E402
from megarl.engine.megatron import TrainEngine  # noqa: E402
from megarl.engine.parallel import init_parallel  # noqa: E402
from megarl.handoff import push_weights  # noqa: E402
from megarl.rollout.native import NativeEngine  # noqa: E402
from megarl.rollout.sglang_engine import SGLangEngine  # noqa: E402
from megarl.models.arch import read_shape  # noqa: E402

PROMPTS = [[21, 22, 15, 23, 25, 33], [30, 31, 15, 33], [24, 15, 24, 33, 4]]
EOS_ID = 0


def hf_logprobs(model_dir: str, tokens: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """Token logprobs [B, T] of a transformers model (column 0 is 0), the reference for the engines."""
    native = NativeEngine(model_dir, seed=0, device="cpu")
    with torch.no_grad():
        logits = native.model(input_ids=tokens).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


def mean_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().sum() / mask.sum())


def stop_summary(gen, *, max_new_tokens: int) -> dict:
    """What the EOS test asserts about one engine's responses."""
    return {
        "lengths": [len(ids) for ids in gen.response_ids],
        "reasons": gen.finish_reasons,
        "ends_with_eos": [bool(ids) and ids[-1] == EOS_ID for ids in gen.response_ids],
        "eos_inside": sum(EOS_ID in ids[:-1] for ids in gen.response_ids),
        "max_new_tokens": max_new_tokens,
    }


def cpu_checks(args) -> dict:
    groups = init_parallel(tp=1, pp=1, seed=0)
    trainer = TrainEngine(model_dir=args.trainer_model, shape=read_shape(args.trainer_model), dtype="float32", megatron={}, groups=groups)
    engine = SGLangEngine(args.other_model, shape=read_shape(args.other_model), dtype="float32", seed=0)
    result = {}
    sample = dict(temperature=0.7, top_p=1.0, max_new_tokens=8, eos_id=EOS_ID, pad_id=0)

    # Before any push the engine serves the other model: its logprobs are that model's, not the trainer's.
    gen = engine.generate(PROMPTS, **sample)
    tokens, mask, lp = pack_sequences(PROMPTS, gen.response_ids, gen.logprobs, pad_id=0)
    result["before_vs_other_hf"] = max_diff(lp, hf_logprobs(args.other_model, tokens, temperature=0.7), mask)
    result["before_vs_trainer"] = max_diff(lp, trainer.logprobs(tokens, temperature=0.7, micro_batch_size=1),
                                           mask)

    # Push the trainer's weights in many small buckets: the engine now computes the trainer's function.
    stats = push_weights(engine, trainer.hf_tensors(), bucket_bytes=16 * 1024, version=1)
    result["push"] = stats
    gen = engine.generate(PROMPTS * 4, **sample)
    tokens, mask, lp = pack_sequences(PROMPTS * 4, gen.response_ids, gen.logprobs, pad_id=0)
    result["after_vs_trainer"] = max_diff(lp, trainer.logprobs(tokens, temperature=0.7, micro_batch_size=4),
                                          mask)
    result["finish_reasons"] = gen.finish_reasons
    result["response_ids"] = gen.response_ids
    result["logprob_lens_match"] = all(len(a) == len(b) for a, b in zip(gen.response_ids, gen.logprobs))
    result["weight_version"] = engine.weight_version
    result["stamped_versions"] = sorted({v for versions in gen.versions for v in versions})  # SGLang's own
    # SGLang's Qwen2 class cannot read a tensor back; megarl's loader checks every one in the scheduler
    checked = push_weights(engine, trainer.hf_tensors(), bucket_bytes=1 << 20, version=1, verify=lambda index: True)
    result["qwen2_verified"], result["qwen2_tensors"] = checked["verified"], checked["tensors"]

    # Push the other model's own tensors back: the engine reproduces that model again.
    other = TrainEngine(model_dir=args.other_model, shape=read_shape(args.other_model), dtype="float32", megatron={}, groups=groups)
    push_weights(engine, other.hf_tensors(), bucket_bytes=1 << 20, version=2)
    gen = engine.generate(PROMPTS, **sample)
    tokens, mask, lp = pack_sequences(PROMPTS, gen.response_ids, gen.logprobs, pad_id=0)
    result["second_push_vs_other_hf"] = max_diff(lp, hf_logprobs(args.other_model, tokens, temperature=0.7), mask)

    # A model that emits EOS often (the test's crafted checkpoint), pushed into the same engine: SGLang and
    # the native engine must both end responses at EOS, and only there.
    eos_model = TrainEngine(model_dir=args.eos_model, shape=read_shape(args.eos_model), dtype="float32", megatron={}, groups=groups)
    push_weights(engine, eos_model.hf_tensors(), bucket_bytes=1 << 20, version=3)
    eos_sample = dict(sample, temperature=1.0, max_new_tokens=12)
    eos_prompts = PROMPTS * 16
    result["eos_sglang"] = stop_summary(engine.generate(eos_prompts, **eos_sample), max_new_tokens=12)
    native = NativeEngine(args.eos_model, seed=0, device="cpu")
    result["eos_native"] = stop_summary(native.generate(eos_prompts, **eos_sample), max_new_tokens=12)

    # A push that names a tensor the model does not have must fail loudly, not be skipped.
    try:
        push_weights(engine, [("model.layers.0.no_such.weight", torch.zeros(2, 2))], bucket_bytes=1 << 20,
                     version=4)
        result["bad_push_error"] = None
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        result["bad_push_error"] = f"{type(e).__name__}: {e}"
    engine.shutdown()
    return result


def gpu_checks(args) -> dict:
    """bf16 on one GPU: CUDA IPC push parity, SGLang memory release/resume."""
    # A one-process NCCL group, as torchrun would make it (gloo cannot reduce CUDA tensors).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    groups = init_parallel(tp=1, pp=1, seed=0)
    trainer = TrainEngine(model_dir=args.trainer_model, shape=read_shape(args.trainer_model), dtype="bfloat16", megatron={}, groups=groups)
    result = {}
    free_before_engine = torch.cuda.mem_get_info()[0]
    engine = SGLangEngine(args.other_model, shape=read_shape(args.other_model), dtype="bfloat16", seed=0, mem_fraction=0.2, base_gpu_id=0)
    free_serving = torch.cuda.mem_get_info()[0]
    result["engine_bytes"] = free_before_engine - free_serving
    sample = dict(temperature=0.7, top_p=1.0, max_new_tokens=8, eos_id=EOS_ID, pad_id=0)
    prompts = PROMPTS * 8

    def vs_trainer(gen) -> tuple[float, float]:
        tokens, mask, lp = pack_sequences(prompts, gen.response_ids, gen.logprobs, pad_id=0)
        ref = trainer.logprobs(tokens, temperature=0.7, micro_batch_size=len(prompts))
        return mean_diff(lp, ref, mask), max_diff(lp, ref, mask)

    result["before_mean"], result["before_max"] = vs_trainer(engine.generate(prompts, **sample))

    # Release everything SGLang holds: device-wide free memory must grow by most of what it took.
    engine.release_memory()
    result["released_bytes"] = torch.cuda.mem_get_info()[0] - free_serving

    # Resume the weights, push the trainer's bf16 tensors through CUDA IPC, then resume the cache.
    engine.resume_weights()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated()
    bucket_bytes = 1 << 20
    stats = push_weights(engine, trainer.hf_tensors(), bucket_bytes=bucket_bytes, version=1)
    result["push"] = stats
    result["push_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - allocated
    result["bucket_bytes"] = bucket_bytes
    result["largest_tensor_bytes"] = max(t.numel() * t.element_size() for _, t in trainer.hf_tensors())
    engine.resume_cache()
    result["free_after_resume"] = torch.cuda.mem_get_info()[0]
    result["free_serving"] = free_serving
    gen = engine.generate(prompts, **sample)
    result["generated_after_resume"] = sum(len(ids) for ids in gen.response_ids)
    result["stamped_versions"] = sorted({v for versions in gen.versions for v in versions})
    result["after_mean"], result["after_max"] = vs_trainer(gen)

    engine.shutdown()
    return result


def readback_checks(args) -> dict:
    """Every pushed tensor checked in SGLang's scheduler equal to the trainer's, and a push that silently skips
    one (the engine is handed its old value) is caught, naming it."""
    from safetensors.torch import load_file

    from faulty_engines import SkippingEngine
    from megarl.handoff import WeightMismatch

    tensors = list(load_file(os.path.join(args.trainer_model, "model.safetensors")).items())
    pushes = [[(name, t + p * 1e-3) for name, t in tensors] for p in (1, 2)]  # other values at every push
    skipped = tensors[4][0]
    engine = SkippingEngine(SGLangEngine(args.trainer_model, shape=read_shape(args.trainer_model), dtype="float32", seed=0), name=skipped, start=2)
    every = dict(bucket_bytes=1 << 20, verify=lambda index: True, engine_name="rollout engine 0")
    result = {"tensors": len(tensors), "skipped": skipped}
    result["verified"] = push_weights(engine, iter(pushes[0]), version=1, **every)["verified"]
    try:
        push_weights(engine, iter(pushes[1]), version=2, **every)
        result["mismatch"] = None
    except WeightMismatch as e:
        result["mismatch"] = str(e)
    engine.shutdown()
    return result


def lora_checks(args) -> dict:
    """A LoRA policy's adapters pushed alone (rollout.lora_sync: adapter) into SGLang, which started from the base
    model: its logprobs are the trainer's adapted policy's. Twice, with other adapters the second time (the
    engine drops the first), and the native engine, which merges what it is pushed, against the same policy."""
    from megarl.config import LoraConfig, OptimConfig

    groups = init_parallel(tp=1, pp=1, seed=0)
    lora = LoraConfig(rank=4, alpha=8.0, targets=["qkv", "proj", "fc1", "fc2"])
    trainer = TrainEngine(model_dir=args.trainer_model, shape=read_shape(args.trainer_model), dtype="float32", megatron={}, groups=groups, lora=lora,
                          optim=OptimConfig(lr=1e-2), seed=0)
    engine = SGLangEngine(args.trainer_model, shape=read_shape(args.trainer_model), dtype="float32", seed=0, lora=lora)
    native = NativeEngine(args.trainer_model, seed=0, device="cpu")
    sample = dict(temperature=0.7, top_p=1.0, max_new_tokens=8, eos_id=EOS_ID, pad_id=0)
    generator = torch.Generator().manual_seed(0)
    result = {}
    for version in (1, 2):
        # B is zero in a fresh policy: adapters of the size training gives them, drawn anew for each version
        with torch.no_grad():
            for _, layer in trainer.stage.adapted_layers():
                layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=generator) * 0.2)
        adapters = list(trainer.pipeline_adapter_tensors())
        result[f"v{version}_adapter_bytes"] = sum(t.numel() * t.element_size() for _, t in adapters)
        for name, rollout in (("sglang", engine), ("native", native)):
            rollout.update_adapter(adapters, rank=lora.rank, alpha=lora.alpha, version=version)
            rollout.flush_cache()
            gen = rollout.generate(PROMPTS * 4, **sample)
            tokens, mask, lp = pack_sequences(PROMPTS * 4, gen.response_ids, gen.logprobs, pad_id=0)
            result[f"v{version}_{name}_vs_trainer"] = max_diff(
                lp, trainer.logprobs(tokens, temperature=0.7, micro_batch_size=4), mask)
            result[f"v{version}_{name}_vs_base"] = max_diff(
                lp, hf_logprobs(args.trainer_model, tokens, temperature=0.7), mask)
            result[f"v{version}_{name}_versions"] = sorted({v for vs in gen.versions for v in vs})
    result["model_bytes"] = sum(t.numel() * t.element_size() for _, t in trainer.hf_tensors())
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["cpu", "gpu", "readback", "lora"])
    parser.add_argument("--trainer-model", required=True)
    parser.add_argument("--other-model", help="cpu, gpu: same architecture, other weights")
    parser.add_argument("--eos-model", help="cpu: same architecture, emits EOS often")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"cpu": cpu_checks, "gpu": gpu_checks, "readback": readback_checks, "lora": lora_checks}[args.mode](args)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
