"""HF <-> Megatron tensor layouts and name tables: fused qkv and gate/up both ways, TP shard/unshard,
and name rules that cover the tiny checkpoints exactly, for the local and the Transformer Engine spec."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from megarl.models.arch import read_shape
from megarl.models.layout import join_gate_up, join_qkv, shard, split_gate_up, split_qkv, unshard
from megarl.models.names import NameTable, fill, name_rules

ARCHS = ("qwen2", "llama", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3",
         "gpt_oss", "gemma3")


def distinct(*shape: int, offset: float = 0.0) -> torch.Tensor:
    """A tensor whose entries all differ, so any misplaced element shows."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape) + offset


# ---- fused qkv --------------------------------------------------------------------------------------------
def test_join_qkv_orders_query_heads_then_key_then_value_per_group():
    # heads=4, groups=2, head_dim=1: group g holds query heads 2g, 2g+1, then key head g, then value head g.
    q = torch.tensor([[0.0, 0.5], [1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])  # [heads*hd, in]
    k = torch.tensor([[10.0, 10.5], [11.0, 11.5]])  # [groups*hd, in]
    v = torch.tensor([[20.0, 20.5], [21.0, 21.5]])
    qkv = join_qkv(q, k, v, groups=2, head_dim=1)
    assert qkv[:, 0].tolist() == [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]
    assert torch.equal(qkv[:, 1], qkv[:, 0] + 0.5)  # rows move whole
    bias = join_qkv(q[:, 0], k[:, 0], v[:, 0], groups=2, head_dim=1)
    assert bias.tolist() == [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]


def test_join_qkv_keeps_each_head_dim_block_contiguous():
    # heads=2, groups=1, head_dim=2: [q0 (2 rows), q1 (2 rows), k (2 rows), v (2 rows)]
    q, k, v = distinct(4), distinct(2, offset=10), distinct(2, offset=20)
    assert join_qkv(q, k, v, groups=1, head_dim=2).tolist() == [0, 1, 2, 3, 10, 11, 20, 21]


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 2, 16), (4, 4, 8), (8, 1, 4), (6, 3, 2)])
def test_qkv_round_trip_weights_and_biases(heads, groups, head_dim):
    hidden = 12
    q = distinct(heads * head_dim, hidden)
    k = distinct(groups * head_dim, hidden, offset=1e4)
    v = distinct(groups * head_dim, hidden, offset=2e4)
    fused = join_qkv(q, k, v, groups=groups, head_dim=head_dim)
    assert fused.shape == ((heads + 2 * groups) * head_dim, hidden)
    for got, want in zip(split_qkv(fused, groups=groups, head_dim=head_dim), (q, k, v)):
        assert torch.equal(got, want)
    biases = q[:, 0], k[:, 0], v[:, 0]
    fused_bias = join_qkv(*biases, groups=groups, head_dim=head_dim)
    assert fused_bias.shape == ((heads + 2 * groups) * head_dim,)
    for got, want in zip(split_qkv(fused_bias, groups=groups, head_dim=head_dim), biases):
        assert torch.equal(got, want)


# ---- fused gate/up ----------------------------------------------------------------------------------------
def test_gate_up_round_trip_weights_and_biases():
    gate, up = distinct(6, 4), distinct(6, 4, offset=100)
    fc1 = join_gate_up(gate, up)
    assert torch.equal(fc1, torch.cat([gate, up]))  # [gate; up]
    got_gate, got_up = split_gate_up(fc1)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)
    got_gate, got_up = split_gate_up(join_gate_up(gate[:, 0], up[:, 0]))
    assert torch.equal(got_gate, gate[:, 0]) and torch.equal(got_up, up[:, 0])


# ---- tensor-parallel shards -------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_unshard_round_trip(dim):
    full = distinct(8, 6)
    shards = [shard(full, dim=dim, rank=r, size=2) for r in range(2)]
    assert torch.equal(shards[0], full.narrow(dim, 0, full.shape[dim] // 2))
    assert torch.equal(shards[1], full.narrow(dim, full.shape[dim] // 2, full.shape[dim] // 2))
    assert torch.equal(unshard(shards, dim=dim), full)


def test_gate_up_shards_split_each_half_separately():
    gate, up = distinct(4, 3), distinct(4, 3, offset=100)
    fc1 = join_gate_up(gate, up)  # rows [g0 g1 g2 g3 u0 u1 u2 u3]
    shards = [shard(fc1, dim=0, rank=r, size=2, gate_up=True) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([gate[:2], up[:2]]))  # rank 0: [g0 g1; u0 u1]
    assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))
    assert torch.equal(unshard(shards, dim=0, gate_up=True), fc1)


def test_replicated_tensors_are_not_split():
    full = distinct(4)
    assert torch.equal(shard(full, dim=None, rank=1, size=2), full)
    assert torch.equal(unshard([full, full], dim=None), full)


# ---- name tables ------------------------------------------------------------------------------------------
@pytest.fixture(params=ARCHS)
def model_dir(request, arch_dir):
    return arch_dir(request.param)


@pytest.mark.parametrize("te_spec", [False, True], ids=["local", "te"])
def test_rules_cover_every_hf_tensor_exactly_once(model_dir, te_spec):
    shape = read_shape(model_dir)
    covered = Counter()
    for rule in name_rules(shape, te_spec=te_spec):
        layers = [i for i in range(shape.layers) if rule.moe in (None, shape.is_moe_layer(i))] \
            if "{}" in rule.megatron else [None]
        experts = range(shape.experts) if "{e}" in rule.megatron else [None]
        for layer in layers:
            # a stacked HF tensor (gpt-oss's experts) is one name for every expert of its layer
            covered.update({fill(n, layer=layer, expert=expert) for expert in experts for n in rule.hf})
    checkpoint = set(load_file(str(model_dir / "model.safetensors")))
    assert set(covered) == checkpoint
    assert all(count == 1 for count in covered.values()), [n for n, c in covered.items() if c > 1]


def test_expert_names_map_local_index_plus_offset_to_the_global_hf_expert(arch_dir):
    # Expert-parallel rank 1 of 2 with 4 experts holds global experts 2 and 3 as local experts 0 and 1.
    local = NameTable(name_rules(read_shape(arch_dir("qwen2_moe"))))
    rule, layer, expert = local.lookup("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight")
    assert (layer, expert, rule.fuse) == (1, 1, "gate_up")
    assert local.hf_names("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", expert_offset=2) == (
        "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight")
    assert local.hf_names("decoder.layers.0.mlp.router.weight") == ("model.layers.0.mlp.gate.weight",)
    assert local.hf_names("decoder.layers.0.mlp.shared_experts.gate_weight") == (
        "model.layers.0.mlp.shared_expert_gate.weight",)
    # Mixtral's HF names: block_sparse_moe, w1 = gate, w3 = up, w2 = down.
    mixtral = NameTable(name_rules(read_shape(arch_dir("mixtral"))))
    assert mixtral.hf_names("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", expert_offset=2) == (
        "model.layers.0.block_sparse_moe.experts.2.w1.weight", "model.layers.0.block_sparse_moe.experts.2.w3.weight")
    assert mixtral.hf_names("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight") == (
        "model.layers.0.block_sparse_moe.experts.0.w2.weight",)


def test_te_spec_names_grouped_experts_and_keeps_the_moe_pre_mlp_norm(arch_dir):
    # TEGroupedMLP suffixes the expert index to the weight name; MoE layers keep a separate pre-MLP norm.
    table = NameTable(name_rules(read_shape(arch_dir("qwen3_moe")), te_spec=True))
    assert table.hf_names("decoder.layers.1.mlp.experts.linear_fc2.weight3") == (
        "model.layers.1.mlp.experts.3.down_proj.weight",)
    assert table.hf_names("decoder.layers.0.pre_mlp_layernorm.weight") == (
        "model.layers.0.post_attention_layernorm.weight",)
    assert table.hf_names("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == (
        "model.layers.0.input_layernorm.weight",)
    with pytest.raises(KeyError):
        table.lookup("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")


def test_te_spec_maps_fused_norm_weights_to_the_hf_norms(qwen2_dir):
    table = NameTable(name_rules(read_shape(qwen2_dir), te_spec=True))
    assert table.hf_names("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight") == (
        "model.layers.1.input_layernorm.weight",)
    assert table.hf_names("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == (
        "model.layers.0.post_attention_layernorm.weight",)
    # The fused linear weights themselves keep their local-spec names under TE.
    assert table.hf_names("decoder.layers.0.self_attention.linear_qkv.weight") == tuple(
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def test_layer_rules_fill_in_the_global_layer_index(llama_dir):
    table = NameTable(name_rules(read_shape(llama_dir)))
    rule, layer, _ = table.lookup("decoder.layers.17.mlp.linear_fc1.weight")
    assert layer == 17 and rule.fuse == "gate_up"
    assert table.hf_names("decoder.layers.17.mlp.linear_fc1.weight") == (
        "model.layers.17.mlp.gate_proj.weight", "model.layers.17.mlp.up_proj.weight")
    assert table.hf_names("output_layer.weight") == ("lm_head.weight",)


@pytest.mark.parametrize("name", ["decoder.layers.0.self_attention.linear_qkv.bias_typo",
                                  "decoder.layers.x.input_layernorm.weight", "output_layer.weight",
                                  "embedding.position_embeddings.weight"])
def test_unknown_megatron_name_raises_key_error_naming_it(qwen2_dir, name):
    # qwen2 ties its embeddings, so it has no output_layer rule.
    table = NameTable(name_rules(read_shape(qwen2_dir)))
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        table.lookup(name)


# ---- parallel layout checks ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout,message", [
    (dict(tp=2, pp=1, cp=1, world_size=3), "world size 3 is not divisible by parallel.tp * parallel.pp * parallel.cp = 2"),
    (dict(tp=8, pp=1, cp=1, world_size=8), "attention heads 4 is not divisible by parallel.tp = 8"),
    (dict(tp=4, pp=1, cp=1, world_size=4), "key/value heads (query groups) 2 is not divisible by parallel.tp = 4"),
    (dict(tp=1, pp=3, cp=1, world_size=3), "layers 2 is not divisible by parallel.pp = 3"),
    (dict(tp=1, pp=1, cp=1, world_size=1, vpp=2),
     "model.megatron.virtual_pipeline_model_parallel_size = 2 needs parallel.pp >= 2, got parallel.pp = 1"),
    (dict(tp=1, pp=2, cp=1, world_size=2, vpp=2),
     "layers 2 is not divisible by parallel.pp * model.megatron.virtual_pipeline_model_parallel_size = 2 * 2 = 4"),
])
def test_layout_that_does_not_divide_names_both_numbers(qwen2_dir, layout, message):
    from megarl.layout import check_layout

    with pytest.raises(ValueError) as err:
        check_layout(read_shape(qwen2_dir), **layout)
    assert str(err.value) == message


@pytest.mark.parametrize("layout,message", [
    (dict(tp=1, pp=1, cp=1, ep=3, world_size=3), "experts 4 is not divisible by parallel.ep = 3"),
    (dict(tp=1, pp=2, cp=1, ep=2, world_size=2),
     "world size 2 is not divisible by parallel.tp * parallel.ep * parallel.pp = 4"),
    (dict(tp=2, pp=1, cp=1, ep=4, world_size=4, sequence_parallel=True),
     "world size 4 is not divisible by parallel.tp * parallel.ep * parallel.pp = 8"),
    (dict(tp=2, pp=1, cp=1, ep=1, world_size=2),
     "parallel.tp = 2 with a mixture-of-experts model (mixtral) needs model.megatron.sequence_parallel: true"),
    # expert tensor parallelism (parallel.etp) apart from TP: the expert grid is etp * ep * pp, the expert width
    # splits by etp
    (dict(tp=1, pp=1, cp=1, ep=2, etp=2, world_size=2),
     "world size 2 is not divisible by parallel.etp * parallel.ep * parallel.pp = 4"),
    (dict(tp=1, pp=1, cp=1, ep=2, etp=3, world_size=6), "expert MLP width 128 is not divisible by parallel.etp = 3"),
    (dict(tp=2, pp=1, cp=1, ep=1, etp=1, world_size=2, sequence_parallel=True),
     "parallel.etp = 1 differs from parallel.tp = 2 with parallel.ep = 1: Megatron reduces the experts' gradients "
     "over their own data-parallel ranks only under expert parallelism; set parallel.ep > 1, or leave parallel.etp "
     "unset"),
])
def test_expert_layout_that_does_not_divide_names_both_numbers(arch_dir, layout, message):
    from megarl.layout import check_layout

    with pytest.raises(ValueError) as err:
        check_layout(read_shape(arch_dir("mixtral")), **layout)
    assert str(err.value) == message


def test_expert_parallel_needs_experts(qwen2_dir):
    from megarl.layout import check_layout

    with pytest.raises(ValueError, match="parallel.ep = 2 needs a mixture-of-experts model; qwen2 has no experts"):
        check_layout(read_shape(qwen2_dir), tp=1, pp=1, cp=1, ep=2, world_size=2)
    with pytest.raises(ValueError, match="parallel.etp = 1 needs a mixture-of-experts model; qwen2 has no experts"):
        check_layout(read_shape(qwen2_dir), tp=2, pp=1, cp=1, etp=1, world_size=2)
    check_layout(read_shape(qwen2_dir), tp=2, pp=1, cp=1, etp=2, world_size=2)  # etp = tp: Megatron's default


def test_expert_tensor_parallel_layouts_that_divide_pass(arch_dir):
    """Each expert whole (etp 1) while attention splits over TP, the experts over EP on the same or more ranks;
    and each expert split over more ranks than attention (etp 2 under tp 1)."""
    from megarl.layout import check_layout

    shape = read_shape(arch_dir("mixtral"))
    for tp, pp, ep, etp, world in [(2, 1, 2, 1, 2), (2, 2, 2, 1, 4), (2, 1, 4, 1, 4), (1, 1, 2, 2, 4)]:
        check_layout(shape, tp=tp, pp=pp, cp=1, ep=ep, etp=etp, world_size=world, sequence_parallel=tp > 1)


def test_qwen_moe_with_dense_layers_is_refused_naming_the_file(arch_dir, tmp_path):
    import json
    import shutil

    shutil.copy(arch_dir("qwen2_moe") / "config.json", tmp_path / "config.json")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [0]}))
    with pytest.raises(ValueError, match=r"config\.json: dense layers between MoE layers \(mlp_only_layers \[0\]"):
        read_shape(tmp_path)


def test_moe_shapes_read_the_router_convention(arch_dir):
    mixtral, qwen2_moe, qwen3_moe = (read_shape(arch_dir(a)) for a in ("mixtral", "qwen2_moe", "qwen3_moe"))
    assert (mixtral.experts, mixtral.topk, mixtral.moe_ffn, mixtral.norm_topk, mixtral.aux_loss_coeff) == (
        4, 2, 128, True, 0.02)
    assert (qwen2_moe.moe_ffn, qwen2_moe.shared_ffn, qwen2_moe.norm_topk, qwen2_moe.qkv_bias) == (32, 48, False, True)
    assert (qwen3_moe.moe_ffn, qwen3_moe.shared_ffn, qwen3_moe.norm_topk, qwen3_moe.qk_norm) == (32, 0, True, True)


def test_layouts_that_divide_pass(qwen2_dir):
    from megarl.layout import check_layout

    shape = read_shape(qwen2_dir)
    for tp, pp, world in [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 4), (2, 1, 4), (1, 1, 8)]:
        check_layout(shape, tp=tp, pp=pp, cp=1, world_size=world)
