"""megarl.rollout.native: sampling records no autograd graph and samples exactly what it sampled with autograd on
(same seed: same tokens, same logprobs)."""

from __future__ import annotations

import pytest
import torch

from megarl.rollout.native import NativeEngine

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 2


def sample(engine: NativeEngine, generate=None):
    generate = generate or engine.generate
    return generate(PROMPTS, temperature=1.0, top_p=1.0, max_new_tokens=8, eos_id=2, pad_id=0)


@pytest.mark.parametrize("lean_decode", [True, False])
def test_generation_records_no_autograd_graph(qwen2_dir, lean_decode):
    """The vocabulary projection runs in every forward, lean (megarl.rollout.decode) or transformers' own."""
    engine = NativeEngine(str(qwen2_dir), seed=3, device="cpu", lean_decode=lean_decode)
    seen = []
    engine.model.lm_head.register_forward_hook(lambda module, args, output: seen.append(
        (output.requires_grad, torch.is_inference_mode_enabled())))
    sample(engine)
    assert len(seen) >= 2 and all(not grad and inference for grad, inference in seen), seen[:3]


def test_inference_mode_samples_what_autograd_mode_sampled(qwen2_dir):
    fast = sample(NativeEngine(str(qwen2_dir), seed=3, device="cpu"))
    slow_engine = NativeEngine(str(qwen2_dir), seed=3, device="cpu")
    with torch.enable_grad():  # the generation as it ran before, recording a graph it never used
        slow = sample(slow_engine, lambda *a, **k: NativeEngine.generate.__wrapped__(slow_engine, *a, **k))
    assert fast.response_ids == slow.response_ids
    assert fast.logprobs == slow.logprobs  # bit for bit: the same kernels on the same inputs
    assert fast.finish_reasons == slow.finish_reasons


def test_sampled_logprobs_are_those_of_a_full_forward_of_each_sequence(qwen2_dir):
    """What the trainer recomputes: each response token's logprob from one forward of its own sequence
    (prompt and response, no padding, no cache). 1e-5: fp32, cached decode against a whole-sequence pass."""
    from transformers import AutoModelForCausalLM

    out = sample(NativeEngine(str(qwen2_dir), seed=5, device="cpu"))
    model = AutoModelForCausalLM.from_pretrained(str(qwen2_dir), dtype=torch.float32).eval()
    assert any(len(ids) > 1 for ids in out.response_ids)
    for prompt, ids, logprobs in zip(PROMPTS, out.response_ids, out.logprobs):
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            full = torch.log_softmax(model(seq).logits[0, len(prompt) - 1: -1].float(), dim=-1)
        expected = full.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5), (prompt, ids)


# ---- lean decode steps -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "mistral"])
def test_lean_decode_samples_what_transformers_forward_samples(arch, arch_dir):
    """The engine runs megarl.rollout.decode's lean prefill and steps instead of transformers' forward: the
    same seed draws the same tokens, with logprobs within 1e-6 (fp32: the same weights and sums; the
    attention kernel and the norms' order of operations may round differently). PROMPTS repeat, so the
    prefill reads each distinct prompt once and copies its keys and values to every row that shares it."""
    from megarl.rollout import decode

    model_dir = str(arch_dir(arch))
    lean_engine = NativeEngine(model_dir, seed=7, device="cpu")
    assert lean_engine.lean_decode and decode.covers(lean_engine.model, 64)
    steps, prefills = [], []
    original, original_prefill = decode.LeanDecoder.step, decode.LeanDecoder.prefill
    decode.LeanDecoder.step = lambda self, *a: steps.append(a[-1]) or original(self, *a)
    decode.LeanDecoder.prefill = lambda self, ids, *a: prefills.append(len(ids)) or original_prefill(self, ids, *a)
    try:
        lean = sample(lean_engine)
    finally:
        decode.LeanDecoder.step, decode.LeanDecoder.prefill = original, original_prefill
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3  # the lean steps ran
    assert prefills == [3]  # one lean prefill, of the 3 distinct prompts
    full_engine = NativeEngine(model_dir, seed=7, device="cpu", lean_decode=False)
    full = sample(full_engine)
    assert lean.response_ids == full.response_ids and lean.finish_reasons == full.finish_reasons
    for got, want in zip(lean.logprobs, full.logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)
    # A weight push reaches the fused projections the lean steps read (the parameters are views of them).
    gen = torch.Generator().manual_seed(0)
    pushed = [(name, param.detach() + 0.05 * torch.randn(param.shape, generator=gen))
              for name, param in full_engine.model.named_parameters()]
    for engine in (lean_engine, full_engine):
        engine.update_weights([pushed], version=1)
    lean, full = sample(lean_engine), sample(full_engine)
    assert lean.response_ids == full.response_ids
    for got, want in zip(lean.logprobs, full.logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)


def test_lean_prefill_of_distinct_left_padded_prompts_matches_transformers(qwen2_dir):
    """Every prompt distinct, of three lengths (left padding of 0, 1 and 2 positions): the same tokens and
    logprobs within 1e-6 as transformers' forward, as above."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17, 18]]
    outs = [NativeEngine(str(qwen2_dir), seed=11, device="cpu", lean_decode=lean).generate(
        prompts, temperature=1.0, top_p=1.0, max_new_tokens=8, eos_id=2, pad_id=0) for lean in (True, False)]
    assert outs[0].response_ids == outs[1].response_ids and outs[0].finish_reasons == outs[1].finish_reasons
    for got, want in zip(outs[0].logprobs, outs[1].logprobs):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)


def test_lean_decode_leaves_what_it_does_not_cover_to_transformers(arch_dir):
    """Mixture-of-experts models and a sliding window shorter than the sequence keep transformers' forward."""
    from megarl.rollout.decode import covers

    moe = NativeEngine(str(arch_dir("mixtral")), seed=0, device="cpu")
    assert not covers(moe.model, 16)
    mistral = NativeEngine(str(arch_dir("mistral")), seed=0, device="cpu")
    assert covers(mistral.model, 256) and not covers(mistral.model, 257)
