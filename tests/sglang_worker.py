"""Run in a subprocess by test_sglang.py: the real SGLang engine against the Megatron trainer.

A scheduler exception in SGLang kills the whole process tree, so each check runs here and writes its
numbers to --out as JSON; the test reads and asserts them.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

warnings.filterwarnings("ignore")

from megarl.batch import pack_sequences  # noqa: E402
from megarl.engine.megatron import TrainEngine, init_parallel  # noqa: E402
from megarl.handoff import push_weights  # noqa: E402
from megarl.rollout.native import NativeEngine  # noqa: E402
from megarl.rollout.sglang_engine import SGLangEngine  # noqa: E402

PROMPTS = [[21, 22, 15, 23, 25, 33], [30, 31, 15, 33], [24, 15, 24, 33, 4]]


def hf_logprobs(model_dir: str, tokens: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """Token logprobs [B, T] of a transformers model (column 0 is 0), the reference for the engines."""
    native = NativeEngine(model_dir, seed=0)
    with torch.no_grad():
        logits = native.model(input_ids=tokens).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer-model", required=True)
    parser.add_argument("--other-model", required=True, help="same architecture, other weights")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    groups = init_parallel(tp=1, pp=1, seed=0)
    trainer = TrainEngine(model_dir=args.trainer_model, dtype="float32", megatron={}, groups=groups)
    engine = SGLangEngine(args.other_model, dtype="float32", seed=0)
    result = {}
    sample = dict(temperature=0.7, top_p=1.0, max_new_tokens=8, eos_id=0, pad_id=0)

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

    # Push the other model's own tensors back: the engine reproduces that model again.
    other = TrainEngine(model_dir=args.other_model, dtype="float32", megatron={}, groups=groups)
    push_weights(engine, other.hf_tensors(), bucket_bytes=1 << 20, version=2)
    gen = engine.generate(PROMPTS, **sample)
    tokens, mask, lp = pack_sequences(PROMPTS, gen.response_ids, gen.logprobs, pad_id=0)
    result["second_push_vs_other_hf"] = max_diff(lp, hf_logprobs(args.other_model, tokens, temperature=0.7), mask)

    # A push that names a tensor the model does not have must fail loudly, not be skipped.
    try:
        push_weights(engine, [("model.layers.0.no_such.weight", torch.zeros(2, 2))], bucket_bytes=1 << 20,
                     version=3)
        result["bad_push_error"] = None
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        result["bad_push_error"] = f"{type(e).__name__}: {e}"
    engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
