"""Gemma 3's text model (HF model_type gemma3_text) on megarl's Megatron engine, beyond what the architecture
lists of test_engine.py (parity, name rules, bit-exact hf_tensors, push), test_layout.py (name tables, both specs),
test_convert.py (HF -> Megatron -> HF) and test_parallel.py (TP=2, PP=2, TP=2 with sequence parallelism and
packing) already run on the tiny gemma3 checkpoint (tools/make_tiny_model.py --arch gemma3: a local layer with a
window of 8 tokens, then a global one with linear RoPE scaling; query_pre_attn_scalar 24 for a head dim of 16;
final logits softcapped at 2).

Tolerance: 1e-5 on fp32 logits and logprobs, ten times tighter than the engine tests' contract (DESIGN: 1e-4).
Measured: 0.0, the engine's and transformers' sums run in the same order here.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_python
from test_engine import fixed_tokens, hf_logits, make_engine, token_logprobs

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5
MOVED = 1e-3  # a Gemma piece left out moves some logit by more than this (measured: >= 1e-2)


@pytest.fixture(scope="module")
def gemma3_dir(arch_dir):
    return arch_dir("gemma3")


def variant(model_dir, out, **changes):
    """A copy of checkpoint `model_dir` in `out` (weights linked) with config.json keys replaced by `changes`."""
    out.mkdir()
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item)
    config = json.loads((model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | changes))
    return out


def megatron_logits(engine, tokens: torch.Tensor) -> torch.Tensor:
    """The engine's GPTModel logits [B, T, padded V] on one rank."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        return engine.module(tokens, positions, None)


def test_logits_and_logprobs_equal_transformers_within_1e_5(gemma3_dir, groups):
    engine = make_engine(gemma3_dir, groups, train=False)
    tokens = fixed_tokens(seq_len=20)  # past the window of 8: the local layer masks what the global one sees
    ref = hf_logits(gemma3_dir, tokens)
    logits = megatron_logits(engine, tokens)
    assert (logits[..., :ref.shape[-1]] - ref).abs().max() <= TOL
    assert ref.abs().max() < 2.0  # softcapped at 2
    for temperature in (1.0, 0.7):
        logprobs = engine.logprobs(tokens, temperature=temperature, micro_batch_size=2)
        assert (logprobs - token_logprobs(ref, tokens, temperature=temperature)).abs().max() <= TOL


# Each of Gemma's pieces, changed in config.json alone, moves transformers' logits far beyond the tolerance, and
# the engine follows it: the parity above holds because each piece is computed, not because it does not matter.
@pytest.mark.parametrize("changes", [
    {"sliding_window": 64},                                       # the local layer's window
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}},
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}},
    {"final_logit_softcapping": None},
    {"query_pre_attn_scalar": 16},
    {"layer_types": ["full_attention", "sliding_attention"]},
], ids=["window", "local-rope-base", "linear-rope-scaling", "softcap", "attention-scale", "layer-types"])
def test_every_gemma_piece_changes_the_logits_and_the_engine_follows(changes, gemma3_dir, groups, tmp_path):
    changed = variant(gemma3_dir, tmp_path / "changed", **changes)
    tokens = fixed_tokens(seq_len=20)
    ref, ref_changed = hf_logits(gemma3_dir, tokens), hf_logits(changed, tokens)
    assert (ref_changed - ref).abs().max() > MOVED
    logits = megatron_logits(make_engine(changed, groups, train=False), tokens)
    assert (logits[..., :ref.shape[-1]] - ref_changed).abs().max() <= TOL


def test_packed_sequences_equal_transformers_per_sequence(gemma3_dir, groups):
    """Sequences of 7 to 19 tokens packed in rows of at most 40: each one's local layer sees only its own last 8
    tokens, never a neighbour's, and its RoPE restarts at its first token."""
    engine = make_engine(gemma3_dir, groups, train=False)
    tokens = fixed_tokens(batch=6, seq_len=19)
    lengths = torch.tensor([19, 7, 12, 16, 9, 14])
    packed = engine.logprobs(tokens, temperature=1.0, micro_batch_size=6, lengths=lengths, micro_batch_tokens=40)
    for i, n in enumerate(lengths.tolist()):
        row = tokens[i: i + 1, :n]
        expected = token_logprobs(hf_logits(gemma3_dir, row), row)[0]
        assert (packed[i, :n] - expected).abs().max() <= TOL, i


def test_local_layer_attends_over_megatrons_sliding_window_also_in_packed_rows(gemma3_dir, groups):
    """The local layer's core attention (megarl's windowed attention, PackedLocalAttention.sink_window_attention)
    computes what Megatron's own attention computes with the layer's window_size (7, 0): a query sees itself and
    the 7 tokens before, HF's sliding_window of 8. Packed, segment by segment and as one block-masked row, it is
    the same window in each segment. 1e-6: fp32, another kernel's order."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megarl.engine.local_attention import block_causal_mask

    local, full = (layer.self_attention.core_attention
                   for layer in make_engine(gemma3_dir, groups, train=False).module.decoder.layers)
    assert (local.window, full.window) == (8, None)  # tokens a query sees, itself included
    heads, kv, dim = local.num_attention_heads_per_partition, local.num_query_groups_per_partition, \
        local.hidden_size_per_attention_head
    gen = torch.Generator().manual_seed(0)
    seq = 20
    q = torch.randn(seq, 1, heads, dim, generator=gen)
    k, v = (torch.randn(seq, 1, kv, dim, generator=gen) for _ in range(2))
    ours = local.attend(q, k, v, None)
    assert local.scale_mask_softmax.window_size == (7, 0)  # Megatron's own sliding-window mask, the reference
    megatron = DotProductAttention.forward(local, q, k, v, None)
    assert (ours - megatron).abs().max() <= 1e-6
    assert (ours - full.attend(q, k, v, None)).abs().max() > MOVED  # the window acted

    bounds = torch.tensor([0, 11, 20], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=11,
                             max_seqlen_kv=11)
    by_segment = local(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params)
    masked = local.attend(q, k, v, block_causal_mask(bounds, seq, device="cpu"))  # the window counted in the row
    assert (by_segment - masked).abs().max() <= 1e-6
    second = local.attend(q[11:], k[11:], v[11:], None)  # the second segment alone
    assert (masked[11:] - second).abs().max() <= 1e-6


def test_te_spec_name_table_maps_the_fused_norms_and_keeps_the_post_norms(gemma3_dir):
    """Transformer Engine's spec fuses the input and pre-MLP norms into linear_qkv and linear_fc1; Gemma's norms
    on the attention and MLP outputs stay modules of the layer (megarl.engine.gemma.PostNormLayer)."""
    from megarl.models.arch import read_shape
    from megarl.models.names import NameTable, name_rules

    shape = read_shape(gemma3_dir)
    te, local = NameTable(name_rules(shape, te_spec=True)), NameTable(name_rules(shape))
    hf = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm",
        "mlp.linear_fc1.layer_norm_weight": "pre_feedforward_layernorm",
        "post_self_attn_layernorm.weight": "post_attention_layernorm",
        "post_mlp_layernorm.weight": "post_feedforward_layernorm",
    }
    for megatron, norm in hf.items():
        assert te.hf_names(f"decoder.layers.1.{megatron}") == (f"model.layers.1.{norm}.weight",)
    assert local.hf_names("decoder.layers.0.pre_mlp_layernorm.weight") == ("model.layers.0.pre_feedforward_layernorm.weight",)
    assert local.hf_names("decoder.layers.0.self_attention.q_layernorm.weight") == ("model.layers.0.self_attn.q_norm.weight",)


# ---- config.json: what is read and what is refused ------------------------------------------------------------
def test_shape_reads_the_older_config_keys_as_transformers_does(gemma3_dir, tmp_path):
    """Configs on the Hub written before transformers 5 give rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern instead of rope_parameters per layer type and layer_types."""
    from transformers import Gemma3TextConfig

    from megarl.models.arch import read_shape

    config = json.loads((gemma3_dir / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        config.pop(key)
    config |= {"num_hidden_layers": 8, "rope_theta": 500_000.0, "rope_local_base_freq": 20_000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = read_shape(tmp_path)
    theirs = Gemma3TextConfig.from_pretrained(tmp_path)
    assert shape.window_layers == tuple(kind == "sliding_attention" for kind in theirs.layer_types)
    assert shape.window_layers == (True, True, True, False) * 2
    assert shape.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 20_000.0
    assert shape.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"] == 500_000.0
    assert shape.rope_linear_factor == theirs.rope_parameters["full_attention"]["factor"] == 8.0
    assert shape.attention_scale == pytest.approx(24 ** -0.5) and shape.local_window == 8


@pytest.mark.parametrize("changes,named", [
    ({"model_type": "gemma3"}, "model_type 'gemma3'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}},
     "rope_parameters.full_attention.rope_type 'yarn'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention.rope_type 'linear'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
], ids=["multimodal", "attention-softcapping", "yarn", "local-linear", "bidirectional", "activation", "layer-type"])
def test_unsupported_config_is_refused_naming_the_file_and_key(changes, named, gemma3_dir, tmp_path):
    from megarl.models.arch import read_shape

    changed = variant(gemma3_dir, tmp_path / "changed", **changes)
    with pytest.raises(ValueError) as refused:
        read_shape(changed)
    assert str(changed / "config.json") in str(refused.value) and named in str(refused.value)


def test_shared_prompts_are_refused_with_sliding_window_layers(gemma3_dir, tmp_path):
    from megarl.config import RecipeError, load_config
    from megarl.job import Job

    cfg = load_config(REPO / "recipes" / "quickstart.yaml", [f"model.path={gemma3_dir}", "train.share_prompts=true",
                                                             "train.micro_batch_tokens=256"], check_paths=False)
    with pytest.raises(RecipeError, match="train.share_prompts .*sliding window"):
        Job.of(cfg, world=1, ranks_per_node=1)


# ---- the conversion tools -------------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_converted_at_tp2_and_back_is_bit_exact_and_loads_in_transformers(gemma3_dir, tmp_path):
    """tools/convert_hf_to_megatron.py at TP=2 (the one-rank round trip is test_convert.py's), then
    tools/convert_megatron_to_hf.py: every tensor back bit for bit, and transformers computes the same logits
    from the export as from the original, exactly."""
    from test_convert import assert_bit_exact, to_hf, to_megatron
    from transformers import AutoModelForCausalLM

    result = to_megatron(gemma3_dir, tmp_path / "megatron", nproc=2, tp=2)
    assert result.returncode == 0, result.stderr[-3000:]
    result = to_hf(tmp_path / "megatron", tmp_path / "hf")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bit_exact(tmp_path / "hf", gemma3_dir)
    tokens = fixed_tokens(batch=2, seq_len=20)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)(tokens).logits
    assert torch.equal(got, hf_logits(gemma3_dir, tokens))


# ---- a short GRPO run --------------------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_two_grpo_steps_of_the_quickstart_score_push_and_export_a_gemma3_model(gemma3_dir, arithmetic_dir, tmp_path):
    """recipes/quickstart.yaml on the tiny Gemma 3, its supervised warm start cut to 20 steps (which trains the
    weights: a model this far from the answers may still earn reward 0, which leaves GRPO's update at zero):
    each step's rewards are scored, the native engine generates with the pushed weights (its logprobs are the
    trainer's), and the HF export holds every tensor of the checkpoint, trained, and loads in transformers as
    Gemma3ForCausalLM."""
    model = tmp_path / "model"
    shutil.copytree(gemma3_dir, model)
    run_dir = tmp_path / "run"
    proc = run_python(["-m", "megarl", "train", str(REPO / "recipes" / "quickstart.yaml"), f"run_dir={run_dir}",
                       f"model.path={model}", "warmup.sft_steps=20", f"data.train_path={arithmetic_dir / 'train.jsonl'}",
                       "data.eval_path=null", "data.prompts_per_step=16", "train.micro_batch_size=16",
                       "train.steps=2", "log.progress=false"], timeout_s=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0.0 <= m["reward/mean"] <= 1.0 and math.isfinite(m["loss"])
        assert m["rollout/logprob_diff_max"] <= 1e-4  # DESIGN contract 2 after each push
    final = run_dir / "checkpoints" / "final"
    exported, original = load_file(str(final / "model.safetensors")), load_file(str(gemma3_dir / "model.safetensors"))
    assert set(exported) == set(original)
    assert any(not torch.equal(exported[n], original[n]) for n in original)  # trained
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    tokens = fixed_tokens(batch=2, seq_len=20)
    with torch.no_grad():
        assert torch.isfinite(hf(tokens).logits).all()
