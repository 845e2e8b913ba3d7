"""gpt-oss (transformers' GptOssForCausalLM) trained by Megatron-core with megarl's local layer spec: the tiny
checkpoint of tools/make_tiny_model.py (4 experts top-2, a sliding window of 8 tokens on layer 0 and full
attention on layer 1, YaRN stretching a 128-token context 4x, random non-zero sinks and biases, a SwiGLU clamp
the activations reach) against transformers, in fp32 on one rank.

What the other suites cover for it through their architecture lists: test_engine (parity at 1e-4, one name rule
per parameter, the bit-exact HF tensors, the weight push), test_convert (HF -> Megatron -> HF bit-exact) and
test_parallel (PP=2, EP=2 and EP=2 packed against one rank, and TP=2 with each expert whole (parallel.etp 1) over
EP=2: Megatron takes biased experts at expert TP 1 only, and test_architectures refuses a larger one). Here: parity at
1e-5 on sequences five times the window, padded and packed; each of gpt-oss's departures from the Llama layer
shown to matter; the stacked-expert layout both ways; routing replay; the conversion at EP=2; a 2-step GRPO run
of the quickstart recipe; and the refusals of what is not supported.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch

import test_router_replay as replay
from conftest import quickstart
from test_convert import assert_bit_exact, to_hf, to_megatron
from test_engine import fixed_tokens, hf_logits, make_engine, token_logprobs

pytestmark = pytest.mark.timeout(600)

FP32_TOL = 1e-5  # measured ~1e-6 at most: the two implementations differ in fp32 summation order only
SEQ_LEN = 40  # five sliding windows of the tiny model


@pytest.fixture(scope="module")
def gpt_oss_dir(arch_dir):
    return arch_dir("gpt_oss")


def hf_sequence_logprobs(model_dir, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, T] transformers' logprobs of each sequence alone (its first lengths[i] tokens; 0 past them)."""
    out = torch.zeros(tokens.shape)
    for i, n in enumerate(lengths):
        out[i, :n] = token_logprobs(hf_logits(model_dir, tokens[i: i + 1, :n]), tokens[i: i + 1, :n])[0]
    return out


def test_logits_and_logprobs_equal_transformers_padded_and_packed(gpt_oss_dir, groups):
    engine = make_engine(gpt_oss_dir, groups, train=False)
    tokens = fixed_tokens(batch=4, seq_len=SEQ_LEN)
    ref_logits = hf_logits(gpt_oss_dir, tokens)
    positions = torch.arange(SEQ_LEN).unsqueeze(0).expand(4, -1)
    with torch.no_grad():
        logits = engine.module(tokens, positions, None)[..., : ref_logits.shape[-1]]
    logit_diff = (logits - ref_logits).abs().max()
    logprobs = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    logprob_diff = (logprobs - token_logprobs(ref_logits, tokens)).abs().max()

    # packed rows of at most 48 tokens: sequences of 40, 33, 26 and 19 tokens, each longer than the window
    lengths = [SEQ_LEN - 7 * i for i in range(4)]
    mask = torch.arange(SEQ_LEN)[None] < torch.tensor(lengths)[:, None]
    packed = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2, micro_batch_tokens=48,
                             lengths=torch.tensor(lengths)) * mask
    packed_diff = (packed - hf_sequence_logprobs(gpt_oss_dir, tokens, lengths)).abs().max()
    print(f"gpt_oss fp32 max |diff|: logits {logit_diff:.3g}, logprobs {logprob_diff:.3g}, packed {packed_diff:.3g}")
    assert logit_diff <= FP32_TOL and logprob_diff <= FP32_TOL and packed_diff <= FP32_TOL


# Each departure from the Llama layer switched off in Megatron alone: parity must break, so the tiny model
# exercises every one of them (the sinks take a visible share, the window is shorter than the sequence, the
# activations reach the clamp, the interleaved experts and YaRN change every token's output).
@pytest.mark.parametrize("megatron,shape_change", [
    ({"softmax_type": "vanilla"}, {}),                     # no sinks in the softmax denominator
    ({"window_attn_skip_freq": [0, 0]}, {}),               # the sliding layer attends to every earlier token
    ({"activation_func_clamp_value": None}, {}),           # SwiGLU without gpt-oss's clamp
    ({"glu_linear_offset": 0.0}, {}),                      # up, not up + 1
    ({}, {"yarn": None}),                                  # plain RoPE frequencies and scale
], ids=["no-sinks", "no-window", "no-clamp", "no-offset", "no-yarn"])
def test_each_gpt_oss_variant_is_needed_for_parity(megatron, shape_change, gpt_oss_dir, groups):
    from megarl.engine.megatron import TrainEngine
    from megarl.models.arch import read_shape

    shape = dataclasses.replace(read_shape(gpt_oss_dir), **shape_change)
    engine = TrainEngine(model_dir=str(gpt_oss_dir), shape=shape, dtype="float32", megatron=megatron, groups=groups)
    tokens = fixed_tokens(batch=2, seq_len=SEQ_LEN)
    logprobs = engine.logprobs(tokens, temperature=1.0, micro_batch_size=2)
    assert (logprobs - token_logprobs(hf_logits(gpt_oss_dir, tokens), tokens)).abs().max() > 1e-3


def test_stacked_expert_layout_both_ways_computes_transformers_experts():
    from megarl.models import layout

    experts, hidden, ffn = 3, 5, 4
    gate_up = torch.randn(experts, hidden, 2 * ffn)  # HF: input-major, gate and up alternating
    gate_up_bias, down = torch.randn(experts, 2 * ffn), torch.randn(experts, ffn, hidden)
    x = torch.randn(7, hidden)
    for e in range(experts):
        fc1, fc1_bias = layout.interleaved_to_fc1(gate_up[e]), layout.interleaved_to_fc1(gate_up_bias[e])
        assert fc1.shape == (2 * ffn, hidden) and fc1_bias.shape == (2 * ffn,)
        assert torch.equal(layout.fc1_to_interleaved(fc1), gate_up[e])
        assert torch.equal(layout.fc1_to_interleaved(fc1_bias), gate_up_bias[e])
        # Megatron's [gate; up] halves are what transformers' GptOssExperts slices out of x @ W + b
        hf = x @ gate_up[e] + gate_up_bias[e]
        gate, up = (x @ fc1.T + fc1_bias).chunk(2, dim=-1)
        assert torch.allclose(gate, hf[..., 0::2], atol=1e-6) and torch.allclose(up, hf[..., 1::2], atol=1e-6)
        fc2 = layout.down_to_fc2(down[e])
        assert fc2.shape == (hidden, ffn) and torch.equal(layout.fc2_to_down(fc2), down[e])
        assert torch.allclose(gate @ fc2.T, gate @ down[e], atol=1e-6)


def test_name_rules_cover_both_layer_specs(gpt_oss_dir):
    from megarl.models.arch import read_shape
    from megarl.models.names import NameTable, name_rules

    shape = read_shape(gpt_oss_dir)
    for te_spec, fc1 in ((False, "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.bias"),
                         (True, "decoder.layers.1.mlp.experts.linear_fc1.bias1")):
        table = NameTable(name_rules(shape, te_spec=te_spec))
        # expert 1 on EP rank 1 of 2 is global expert 3, a row of the layer's stacked tensor
        assert table.hf_names(fc1, expert_offset=2) == ("model.layers.1.mlp.experts.gate_up_proj_bias",)
        assert table.lookup(fc1)[0].fuse == "stacked_gate_up"
        assert table.hf_names("decoder.layers.0.self_attention.core_attention.softmax_offset") == \
            ("model.layers.0.self_attn.sinks",)
        assert table.hf_names("decoder.layers.0.mlp.router.bias") == ("model.layers.0.mlp.router.bias",)
        assert table.hf_names("decoder.layers.0.self_attention.linear_proj.bias") == \
            ("model.layers.0.self_attn.o_proj.bias",)


def test_native_engine_records_gpt_oss_routes(gpt_oss_dir, arch_dir):
    replay.test_native_engine_routes_are_the_experts_a_transformers_forward_chooses("gpt_oss", arch_dir)


def test_replayed_routes_give_transformers_logprobs_under_those_routes(arch_dir, groups):
    replay.test_the_trainer_replays_given_routes_token_by_token("gpt_oss", arch_dir, groups)


def test_r3_with_the_engines_routes_gives_the_engines_logprobs(arch_dir, groups):
    replay.test_r3_with_the_engines_routes_gives_the_engines_logprobs("gpt_oss", arch_dir, groups)


def test_conversion_at_ep2_is_bit_exact_and_loads_in_transformers(gpt_oss_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    result = to_megatron(gpt_oss_dir, tmp_path / "megatron", nproc=2, ep=2)
    assert result.returncode == 0, result.stderr[-3000:]
    result = to_hf(tmp_path / "megatron", tmp_path / "hf")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bit_exact(tmp_path / "hf", gpt_oss_dir)
    tokens = fixed_tokens(batch=2, seq_len=SEQ_LEN)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)(tokens).logits
    assert torch.equal(got, hf_logits(gpt_oss_dir, tokens))


def test_grpo_quickstart_runs_two_steps_and_exports(gpt_oss_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    shutil.copytree(gpt_oss_dir, tmp_path / "model")  # tools/quickstart.sh uses OUT/model as it finds it
    proc = quickstart(tmp_path, "train.steps=2", "warmup.sft_steps=0", "data.prompts_per_step=8",
                      "data.eval_prompts=8", "train.micro_batch_size=16", "log.progress=false", timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(0.0 <= m["reward/mean"] <= 1.0 and m["loss"] == m["loss"] for m in steps)
    export = tmp_path / "run" / "checkpoints" / "final"
    assert json.loads((export / "config.json").read_text())["model_type"] == "gpt_oss"
    tokens = fixed_tokens(batch=1, seq_len=12)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)(tokens).logits
    assert torch.isfinite(logits).all()


# ---- refusals, each naming config.json and its key ----------------------------------------------------------
@pytest.mark.parametrize("change,named", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config.quant_method 'mxfp4'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters.rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                          "attention_factor": 1.5, "rope_theta": 10000.0}}, "rope_parameters.attention_factor"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5"),
    ({"attention_bias": False}, "attention_bias false"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
], ids=["mxfp4", "rope-linear", "yarn-attention-factor", "swiglu-alpha", "no-attention-bias", "layer-types"])
def test_unsupported_configs_are_refused_by_key(change, named, gpt_oss_dir, tmp_path):
    from megarl.models.arch import read_shape

    cfg = json.loads((gpt_oss_dir / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json"))) as refusal:
        read_shape(tmp_path)
    assert named in str(refusal.value)
