"""Megatron <-> HuggingFace parameter names, one declarative table per architecture.

`{}` stands for the global layer index. A rule with several HF names is a fused Megatron tensor; `fuse`
names the layout function that joins and splits it (megarl.models.layout). Norm weights are spelt
differently by the two Megatron layer specs: the local spec has separate `input_layernorm` and
`pre_mlp_layernorm` modules, the Transformer Engine spec fuses them into the next linear layer as
`layer_norm_weight`. Both spellings map to the same HF tensor, so the table works for either spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megarl.models.arch import ModelShape


@dataclass(frozen=True)
class Rule:
    megatron: str                  # Megatron parameter name, `{}` = global layer index
    hf: tuple[str, ...]            # HF name(s); several = the parts of a fused tensor, in join order
    fuse: str | None = None        # None, "qkv" or "gate_up"


def _dense_layer_rules(shape: ModelShape, *, te_spec: bool) -> list[Rule]:
    attn, mlp = "decoder.layers.{}.self_attention", "decoder.layers.{}.mlp"
    hf_attn, hf_mlp, hf_layer = "model.layers.{}.self_attn", "model.layers.{}.mlp", "model.layers.{}"
    input_norm = f"{attn}.linear_qkv.layer_norm_weight" if te_spec else "decoder.layers.{}.input_layernorm.weight"
    mlp_norm = f"{mlp}.linear_fc1.layer_norm_weight" if te_spec else "decoder.layers.{}.pre_mlp_layernorm.weight"
    rules = [
        Rule(input_norm, (f"{hf_layer}.input_layernorm.weight",)),
        Rule(f"{attn}.linear_qkv.weight", tuple(f"{hf_attn}.{p}_proj.weight" for p in "qkv"), "qkv"),
        Rule(f"{attn}.linear_proj.weight", (f"{hf_attn}.o_proj.weight",)),
        Rule(mlp_norm, (f"{hf_layer}.post_attention_layernorm.weight",)),
        Rule(f"{mlp}.linear_fc1.weight", (f"{hf_mlp}.gate_proj.weight", f"{hf_mlp}.up_proj.weight"), "gate_up"),
        Rule(f"{mlp}.linear_fc2.weight", (f"{hf_mlp}.down_proj.weight",)),
    ]
    if shape.qkv_bias:
        rules.append(Rule(f"{attn}.linear_qkv.bias", tuple(f"{hf_attn}.{p}_proj.bias" for p in "qkv"), "qkv"))
    if shape.qk_norm:
        rules.append(Rule(f"{attn}.q_layernorm.weight", (f"{hf_attn}.q_norm.weight",)))
        rules.append(Rule(f"{attn}.k_layernorm.weight", (f"{hf_attn}.k_norm.weight",)))
    return rules


def name_rules(shape: ModelShape, *, te_spec: bool = False) -> list[Rule]:
    """Every Megatron parameter of the model, with the HF tensors it is made of."""
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not shape.tied_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return rules + _dense_layer_rules(shape, te_spec=te_spec)


class NameTable:
    """Looks up the rule of a concrete Megatron name (global layer index filled in)."""

    def __init__(self, rules: list[Rule]):
        self._exact = {r.megatron: r for r in rules if "{}" not in r.megatron}
        self._layer = {r.megatron: r for r in rules if "{}" in r.megatron}

    def lookup(self, megatron_name: str) -> tuple[Rule, int | None]:
        """The rule for `megatron_name` and its layer index (None outside the layers); KeyError if unknown."""
        if megatron_name in self._exact:
            return self._exact[megatron_name], None
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", megatron_name)
        if match:
            key = "decoder.layers.{}." + match.group(2)
            if key in self._layer:
                return self._layer[key], int(match.group(1))
        raise KeyError(f"no HF name known for Megatron parameter {megatron_name!r}")

    def hf_names(self, megatron_name: str) -> tuple[str, ...]:
        rule, layer = self.lookup(megatron_name)
        return tuple(n.replace("{}", str(layer)) for n in rule.hf) if layer is not None else rule.hf
