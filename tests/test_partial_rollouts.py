"""Partial rollouts (megarl.rollout.partial.VersionedEngine): a generation interrupted by a weight push continues
under the new weights, every token keeping the version that sampled it and the logprob it was sampled with.

The "push" here loads a second checkpoint's weights (same architecture, other seed) into the native engine
between two chunks, so tokens of the two versions come from clearly different models; each token's logprob is
checked against transformers' forward of the model of its version on the whole sequence.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.rollout.native import NativeEngine
from megarl.rollout.partial import VersionedEngine

PROMPTS = [[5, 9, 13, 2], [7, 7, 1], [3, 11, 4, 4, 8], [6]]
TEMPERATURE = 0.8


def reference_logprobs(model_dir, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log_softmax(logits / T) of each response token under `model_dir`, from one forward of the whole sequence."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1] / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def test_an_interrupted_generation_continues_under_the_new_weights(qwen2_dir, qwen2_other_dir):
    engine = NativeEngine(str(qwen2_dir), seed=3, device="cpu")
    pushed = []

    def push_once() -> None:  # the trainer's push, arriving after the first chunk
        if not pushed:
            tensors = list(load_file(str(qwen2_other_dir / "model.safetensors")).items())
            engine.update_weights([tensors], version=1)
            engine.flush_cache()
            pushed.append(True)

    versioned = VersionedEngine(engine, chunk_tokens=3, between_chunks=push_once)
    handed = {}
    out = versioned.generate(PROMPTS, temperature=TEMPERATURE, top_p=1.0, max_new_tokens=8, eos_id=0, pad_id=0,
                             on_response=lambda i, ids, lps, reason: handed.setdefault(i, (ids, lps, reason)))
    assert pushed and any(len(set(v)) == 2 for v in out.versions)  # some response was interrupted
    for i, (prompt, ids, logprobs, versions) in enumerate(zip(PROMPTS, out.response_ids, out.logprobs, out.versions)):
        assert handed[i] == (ids, logprobs, out.finish_reasons[i])  # each response handed on once, whole
        assert len(versions) == len(ids) == len(logprobs)
        assert versions == [0] * min(3, len(ids)) + [1] * (len(ids) - 3)  # the first chunk by the old weights
        assert out.finish_reasons[i] == ("stop" if ids[-1] == 0 else "length") and len(ids) <= 8
        old = reference_logprobs(qwen2_dir, prompt, ids)
        new = reference_logprobs(qwen2_other_dir, prompt, ids)
        got = torch.tensor(logprobs)
        by_version = torch.where(torch.tensor(versions) == 0, old, new)
        # 1e-4: the engine's cached decode and one full forward sum the same fp32 products in other orders
        # (contract 2's tolerance); the two models' logprobs differ by far more
        assert torch.allclose(got, by_version, atol=1e-4), (got, by_version)
        if len(ids) > 3:
            assert (got[3:] - old[3:]).abs().max() > 1e-2


def test_one_piece_generation_is_the_engines_own(qwen2_dir):
    """Without chunks the wrapper makes the engine's one call: the same tokens and logprobs for the same seed,
    every token of the engine's version."""
    bare = NativeEngine(str(qwen2_dir), seed=5, device="cpu")
    wrapped = VersionedEngine(NativeEngine(str(qwen2_dir), seed=5, device="cpu"))
    kwargs = dict(temperature=TEMPERATURE, top_p=1.0, max_new_tokens=6, eos_id=0, pad_id=0)
    a, b = bare.generate(PROMPTS, **kwargs), wrapped.generate(PROMPTS, **kwargs)
    assert (a.response_ids, a.logprobs, a.finish_reasons) == (b.response_ids, b.logprobs, b.finish_reasons)
    assert b.versions == [[0] * len(ids) for ids in b.response_ids]
