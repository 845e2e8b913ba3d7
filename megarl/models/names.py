"""Megatron <-> HuggingFace parameter names, one declarative table per architecture.

`{}` stands for the global layer index and `{e}` for an expert index: in a Megatron name the local index
on this expert-parallel rank, in an HF name the global one (the caller passes the offset, ep_rank *
experts_per_rank). A rule with several HF names is a fused Megatron tensor; `fuse` names the layout
function that joins and splits it (megarl.models.layout). Norm weights are spelt differently by the two
Megatron layer specs: the local spec has separate `input_layernorm` and `pre_mlp_layernorm` modules, the
Transformer Engine spec fuses them into the next linear layer as `layer_norm_weight`. Both spellings map to
the same HF tensor, so the table works for either spec. MoE layers keep a separate `pre_mlp_layernorm`
under both specs (the router and the experts both read its output). Gemma 3's norms on the attention and MLP
outputs (`post_self_attn_layernorm`, `post_mlp_layernorm`, megarl.engine.gemma) are separate modules under both.

Experts: the local spec's SequentialMLP holds one MLP per local expert
(`mlp.experts.local_experts.{e}.linear_fc1.weight`); Transformer Engine's TEGroupedMLP holds one grouped
linear layer whose per-expert weights are `mlp.experts.linear_fc1.weight{e}`.

gpt-oss stores each layer's experts stacked in one HF tensor ([experts, ...]): its rules name that tensor (no
`{e}`) with a `stacked_*` fuse, and a Megatron expert is the tensor's row at its global index, in the layout
`fuse` names (megarl.models.layout). Megatron holds the attention sinks as the core attention's `softmax_offset`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from megarl.models.arch import ModelShape


@dataclass(frozen=True)
class Rule:
    megatron: str                  # Megatron parameter name, `{}` = global layer index
    hf: tuple[str, ...]            # HF name(s); several = the parts of a fused tensor, in join order
    fuse: str | None = None        # None, "qkv", "gate_up" or one of STACKED
    moe: bool | None = None        # the layers it names: None every layer, True MoE layers, False dense layers


# Fuses of an HF tensor that stacks every expert of a layer: its row for one expert is, in Megatron's layout,
# linear_fc1 ("stacked_gate_up": gate and up interleaved, input-major), linear_fc2 ("stacked_down": input-major)
# or the tensor as is ("stacked": a bias).
STACKED = ("stacked_gate_up", "stacked_down", "stacked")


# HF names of one expert's gate, up and down projections, relative to the MoE block.
_HF_EXPERT = {"mixtral": ("w1", "w3", "w2")}
_HF_MOE_BLOCK = {"mixtral": "block_sparse_moe"}


def _layer_rules(shape: ModelShape, *, te_spec: bool) -> list[Rule]:
    attn, mlp = "decoder.layers.{}.self_attention", "decoder.layers.{}.mlp"
    hf_attn, hf_mlp, hf_layer = "model.layers.{}.self_attn", "model.layers.{}.mlp", "model.layers.{}"
    input_norm = f"{attn}.linear_qkv.layer_norm_weight" if te_spec and not shape.mla \
        else "decoder.layers.{}.input_layernorm.weight"
    rules = [Rule(input_norm, (f"{hf_layer}.input_layernorm.weight",))]
    rules += _mla_rules(shape, te_spec=te_spec) if shape.mla else [
        Rule(f"{attn}.linear_qkv.weight", tuple(f"{hf_attn}.{p}_proj.weight" for p in "qkv"), "qkv"),
        Rule(f"{attn}.linear_proj.weight", (f"{hf_attn}.o_proj.weight",)),
    ]
    dense_mlp = [
        Rule(f"{mlp}.linear_fc1.weight", (f"{hf_mlp}.gate_proj.weight", f"{hf_mlp}.up_proj.weight"), "gate_up"),
        Rule(f"{mlp}.linear_fc2.weight", (f"{hf_mlp}.down_proj.weight",)),
    ]
    # the norm before the MLP; Gemma 3's post_attention_layernorm is on the attention output instead (post_norms)
    before_mlp = "pre_feedforward" if shape.post_norms else "post_attention"
    moe_norm = Rule("decoder.layers.{}.pre_mlp_layernorm.weight", (f"{hf_layer}.{before_mlp}_layernorm.weight",))
    dense_norm = Rule(f"{mlp}.linear_fc1.layer_norm_weight" if te_spec else moe_norm.megatron, moe_norm.hf)
    if not shape.is_moe:
        rules += [dense_norm, *dense_mlp]
    elif not shape.dense_layers:
        rules += [moe_norm, *_moe_rules(shape, te_spec=te_spec)]
    else:
        # A MoE layer keeps a separate pre_mlp_layernorm under both specs; dense first layers are spelt like a
        # dense model's. The two sets of names never collide, so one table serves every layer.
        rules += [replace(moe_norm, moe=True if te_spec else None),
                  *(replace(rule, moe=True) for rule in _moe_rules(shape, te_spec=te_spec)),
                  *(replace(rule, moe=False) for rule in ([dense_norm] if te_spec else []) + dense_mlp)]
    if shape.qkv_bias:
        rules.append(Rule(f"{attn}.linear_qkv.bias", tuple(f"{hf_attn}.{p}_proj.bias" for p in "qkv"), "qkv"))
    if shape.qk_norm:
        rules.append(Rule(f"{attn}.q_layernorm.weight", (f"{hf_attn}.q_norm.weight",)))
        rules.append(Rule(f"{attn}.k_layernorm.weight", (f"{hf_attn}.k_norm.weight",)))
    if shape.linear_bias:
        rules.append(Rule(f"{attn}.linear_proj.bias", (f"{hf_attn}.o_proj.bias",)))
    if shape.attention_sinks:
        rules.append(Rule(f"{attn}.core_attention.softmax_offset", (f"{hf_attn}.sinks",)))
    if shape.post_norms:  # Gemma 3: HF's post_attention_layernorm is on the attention output, not before the MLP
        rules.append(Rule("decoder.layers.{}.post_self_attn_layernorm.weight",
                          (f"{hf_layer}.post_attention_layernorm.weight",)))
        rules.append(Rule("decoder.layers.{}.post_mlp_layernorm.weight", (f"{hf_layer}.post_feedforward_layernorm.weight",)))
    return rules


def _mla_rules(shape: ModelShape, *, te_spec: bool) -> list[Rule]:
    """Multi-latent attention (DeepSeek-V3): every projection is one HF tensor in the same row order (per head:
    the query's no-RoPE then RoPE dims; the key/value up-projection's key then value dims; the down-projection's
    latent then the shared RoPE key). The latents' norms are fused into the up-projections under Transformer
    Engine."""
    attn, hf_attn = "decoder.layers.{}.self_attention", "model.layers.{}.self_attn"
    q_norm = f"{attn}.linear_q_up_proj.layer_norm_weight" if te_spec else f"{attn}.q_layernorm.weight"
    kv_norm = f"{attn}.linear_kv_up_proj.layer_norm_weight" if te_spec else f"{attn}.kv_layernorm.weight"
    rules = [
        Rule(f"{attn}.linear_kv_down_proj.weight", (f"{hf_attn}.kv_a_proj_with_mqa.weight",)),
        Rule(kv_norm, (f"{hf_attn}.kv_a_layernorm.weight",)),
        Rule(f"{attn}.linear_kv_up_proj.weight", (f"{hf_attn}.kv_b_proj.weight",)),
        Rule(f"{attn}.linear_proj.weight", (f"{hf_attn}.o_proj.weight",)),
    ]
    if not shape.q_lora_rank:
        return rules + [Rule(f"{attn}.linear_q_proj.weight", (f"{hf_attn}.q_proj.weight",))]
    return rules + [
        Rule(f"{attn}.linear_q_down_proj.weight", (f"{hf_attn}.q_a_proj.weight",)),
        Rule(q_norm, (f"{hf_attn}.q_a_layernorm.weight",)),
        Rule(f"{attn}.linear_q_up_proj.weight", (f"{hf_attn}.q_b_proj.weight",)),
    ]


def _moe_rules(shape: ModelShape, *, te_spec: bool) -> list[Rule]:
    mlp = "decoder.layers.{}.mlp"
    hf_block = "model.layers.{}." + _HF_MOE_BLOCK.get(shape.arch, "mlp")
    if shape.arch == "gpt_oss":
        return _stacked_expert_rules(te_spec=te_spec)
    gate, up, down = _HF_EXPERT.get(shape.arch, ("gate_proj", "up_proj", "down_proj"))
    fc1, fc2 = (f"{mlp}.experts.linear_fc1.weight{{e}}", f"{mlp}.experts.linear_fc2.weight{{e}}") if te_spec \
        else (f"{mlp}.experts.local_experts.{{e}}.linear_fc1.weight", f"{mlp}.experts.local_experts.{{e}}.linear_fc2.weight")
    expert = hf_block + ".experts.{e}"
    rules = [
        Rule(f"{mlp}.router.weight", (f"{hf_block}.gate.weight",)),
        Rule(fc1, (f"{expert}.{gate}.weight", f"{expert}.{up}.weight"), "gate_up"),
        Rule(fc2, (f"{expert}.{down}.weight",)),
    ]
    if shape.shared_ffn:
        shared = f"{hf_block}.shared_expert" + ("" if shape.shared_gate else "s")
        rules += [
            Rule(f"{mlp}.shared_experts.linear_fc1.weight", (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
                 "gate_up"),
            Rule(f"{mlp}.shared_experts.linear_fc2.weight", (f"{shared}.down_proj.weight",)),
        ]
    if shape.shared_gate:
        rules.append(Rule(f"{mlp}.shared_experts.gate_weight", (f"{hf_block}.shared_expert_gate.weight",)))
    if shape.expert_bias:
        # a float32 buffer, not a parameter: the routing bias that the policy loss never trains
        rules.append(Rule(f"{mlp}.router.expert_bias", (f"{hf_block}.gate.e_score_correction_bias",)))
    return rules


def _stacked_expert_rules(*, te_spec: bool) -> list[Rule]:
    """gpt-oss's router (with a bias) and its experts, stacked per layer in HF tensors, with their biases."""
    mlp, hf_mlp = "decoder.layers.{}.mlp", "model.layers.{}.mlp"
    expert = (lambda linear, kind: f"{mlp}.experts.{linear}.{kind}{{e}}") if te_spec \
        else (lambda linear, kind: f"{mlp}.experts.local_experts.{{e}}.{linear}.{kind}")
    return [
        Rule(f"{mlp}.router.weight", (f"{hf_mlp}.router.weight",)),
        Rule(f"{mlp}.router.bias", (f"{hf_mlp}.router.bias",)),
        Rule(expert("linear_fc1", "weight"), (f"{hf_mlp}.experts.gate_up_proj",), "stacked_gate_up"),
        Rule(expert("linear_fc1", "bias"), (f"{hf_mlp}.experts.gate_up_proj_bias",), "stacked_gate_up"),
        Rule(expert("linear_fc2", "weight"), (f"{hf_mlp}.experts.down_proj",), "stacked_down"),
        Rule(expert("linear_fc2", "bias"), (f"{hf_mlp}.experts.down_proj_bias",), "stacked"),
    ]


def name_rules(shape: ModelShape, *, te_spec: bool = False) -> list[Rule]:
    """Every Megatron parameter of the model, with the HF tensors it is made of."""
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not shape.tied_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return rules + _layer_rules(shape, te_spec=te_spec)


def fill(template: str, *, layer: int | None = None, expert: int | None = None) -> str:
    """A rule's name with its `{}` layer and `{e}` expert placeholders filled in."""
    if layer is not None:
        template = template.replace("{}", str(layer))
    if expert is not None:
        template = template.replace("{e}", str(expert))
    return template


class NameTable:
    """Looks up the rule of a concrete Megatron name (global layer index, local expert index filled in)."""

    def __init__(self, rules: list[Rule]):
        self._exact = {r.megatron: r for r in rules if "{" not in r.megatron}
        self._patterns = [(re.compile("^" + re.escape(r.megatron).replace(r"\{\}", r"(?P<layer>\d+)")
                                      .replace(r"\{e\}", r"(?P<expert>\d+)") + "$"), r)
                          for r in rules if "{" in r.megatron]

    def lookup(self, megatron_name: str) -> tuple[Rule, int | None, int | None]:
        """The rule for `megatron_name`, its layer index and its (local) expert index, None where the name
        has none; KeyError if unknown."""
        if megatron_name in self._exact:
            return self._exact[megatron_name], None, None
        for pattern, rule in self._patterns:
            match = pattern.match(megatron_name)
            if match:
                found = match.groupdict()
                return rule, int(found["layer"]), int(found["expert"]) if "expert" in found else None
        raise KeyError(f"no HF name known for Megatron parameter {megatron_name!r}")

    def hf_names(self, megatron_name: str, *, expert_offset: int = 0) -> tuple[str, ...]:
        """HF names of a Megatron parameter; a local expert index j becomes the global j + expert_offset."""
        rule, layer, expert = self.lookup(megatron_name)
        return tuple(fill(n, layer=layer, expert=None if expert is None else expert + expert_offset) for n in rule.hf)
