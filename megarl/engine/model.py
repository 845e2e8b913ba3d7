"""Building this rank's share of a model: Megatron's TransformerConfig from an HF architecture, the layer spec
(Transformer Engine's on GPU when installed, the local one otherwise), GPTModel chunks per virtual pipeline
stage, and the critic's value head.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megarl.config import LoraConfig
from megarl.device import current_device, on_gpu
from megarl.engine import cpu_compat, lora as adapters
from megarl.engine.parallel import ParallelGroups
from megarl.job import check_lora, check_megatron_fields, check_virtual_pipeline_p2p, moe_settings
from megarl.layout import check_virtual_stages, virtual_stage_count
from megarl.models.arch import ModelShape, padded_vocab_size
from megarl.models.names import NameTable, name_rules

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_config(shape: ModelShape, *, dtype: str, tp: int, pp: int, megatron: dict, ep: int = 1,
                       etp: int | None = None, cp: int = 1, te_layers: bool | None = None):
    """Megatron TransformerConfig for an HF architecture; `megatron` holds extra fields from the recipe.
    `etp`: the expert tensor-parallel size (None: tp). `te_layers`: the layers are Transformer Engine's (None:
    wherever it is usable, `uses_transformer_engine`)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    te = uses_transformer_engine() if te_layers is None else te_layers

    check_megatron_fields(megatron)
    comm = megatron.get("cp_comm_type")
    if cp > 1 and (comm == "a2a+p2p" or isinstance(comm, list) and "a2a+p2p" in comm):
        # the hierarchical exchange needs hierarchical_context_parallel_sizes at parallel-state init
        raise ValueError("model.megatron.cp_comm_type = 'a2a+p2p' (hierarchical context parallelism) is not "
                          "supported; use 'p2p', 'all_gather' or 'a2a'")
    torch_dtype = _DTYPES[dtype]
    kwargs = dict(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", layernorm_epsilon=shape.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, context_parallel_size=cp,
        params_dtype=torch_dtype, pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16, fp16=torch_dtype == torch.float16,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # Initialization is overwritten by the checkpoint, but it is also what tags each weight with its
        # tensor-parallel split (`tensor_model_parallel`, `partition_dim`), which grad-norm and the
        # weight gathers rely on.
        perform_initialization=True,
    )
    kwargs.update(layer_variants(shape))
    if shape.is_moe:
        kwargs.update(moe_settings(shape, te_layers=te))
    if shape.mla:
        kwargs.update(mla_settings(shape))
    kwargs.update(fused_kernels(te=te) if on_gpu() else cpu_compat.TRANSFORMER_CONFIG)
    if on_gpu() and shape.yarn is not None:
        kwargs["apply_rope_fusion"] = False  # TE's fused RoPE refuses YaRN's cos/sin scale (rope_utils)
    if on_gpu() and te and shape.linear_bias and shape.is_moe:
        kwargs["bias_dropout_fusion"] = False  # TEGroupedMLP refuses it with expert biases
    if shape.post_norms:  # Gemma 3
        from megarl.engine import gemma

        kwargs.update(gemma.transformer_fields(shape))
    vpp = virtual_stage_count(megatron)
    if vpp > 1:
        # What Megatron's own training scripts pick for the interleaved schedule: separate isend/irecv calls,
        # overlapped with compute. Batched into one batch_isend_irecv (the default) with pp = 2, a rank's
        # previous and next stage are the same peer, and gloo pairs the two messages each way by posting
        # order: activations land in gradient buffers and back (measured: wrong losses, no error).
        kwargs.update(batch_p2p_comm=False, overlap_p2p_comm=True)
    kwargs.update(megatron)
    check_virtual_stages(vpp, layers=shape.layers, pp=pp)
    if vpp == 1:
        # One chunk per stage is the plain 1F1B schedule; a size of 1 would select the interleaved one
        # (and its micro-batch rules) for nothing.
        kwargs["virtual_pipeline_model_parallel_size"] = None
    elif not on_gpu():
        check_virtual_pipeline_p2p(batch_p2p_comm=kwargs["batch_p2p_comm"], pp=pp)
    config = (MLATransformerConfig if shape.mla else TransformerConfig)(**kwargs)
    if shape.yarn is not None and not shape.mla:  # multi-latent attention takes YaRN as its own fields
        set_yarn_rope(config, shape)
    return config


def layer_variants(shape: ModelShape) -> dict:
    """TransformerConfig fields of what a shape's layers add to the Llama layer (gpt-oss; none for the others).

    - `linear_bias`: Megatron's add_bias_linear, biases on the attention output, the router and the experts.
    - `attention_sinks`: softmax_type "learnable", a per-head logit in each softmax's denominator, held by the core
      attention as `softmax_offset` (megarl.engine.local_attention applies it on CPU).
    - `window_layers`: window_size (local_window - 1 earlier tokens and none later: transformers' window counts
      the query itself) on the layers whose window_attn_skip_freq entry is 1.
    - `swiglu_limit`: gpt-oss's clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g) with
      g = min(gate, limit), which is Megatron's GLU with quick_gelu, offset 1 and that clamp value.
    """
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    fields = {}
    if shape.linear_bias:
        fields["add_bias_linear"] = True
    if shape.attention_sinks:
        fields["softmax_type"] = "learnable"
    if shape.local_window is not None:
        fields.update(window_size=(shape.local_window - 1, 0),
                      window_attn_skip_freq=[int(windowed) for windowed in shape.window_layers])
    if shape.swiglu_limit is not None:
        fields.update(activation_func=quick_gelu, glu_linear_offset=1.0,
                      activation_func_clamp_value=shape.swiglu_limit)
    return fields


def set_yarn_rope(config, shape: ModelShape) -> None:
    """The YaRN fields GPTModel's "yarn" rotary embedding and the attention's cos/sin scale read from `config`:
    Megatron declares them on its MLA config only and reads them from any config with getattr."""
    yarn = shape.yarn
    config.yarn_rotary_scaling_factor = yarn.factor
    config.yarn_original_max_position_embeddings = yarn.original_max_position
    config.yarn_beta_fast, config.yarn_beta_slow = yarn.beta_fast, yarn.beta_slow
    config.yarn_mscale, config.yarn_mscale_all_dim = yarn.mscale, yarn.mscale_all_dim
    config.yarn_correction_range_round_to_int = yarn.truncate


def mla_settings(shape: ModelShape) -> dict:
    """MLATransformerConfig fields of a multi-latent-attention model (DeepSeek-V3, as transformers computes it).

    Megatron's MLA always rotates interleaved pairs of the RoPE dims (it de-interleaves them before its
    rotate-half), which is DeepSeek's `rope_interleave`; its softmax scale is mscale(factor, mscale_all_dim)^2 /
    sqrt(qk head dim), its YaRN cos/sin scale mscale(factor, mscale) / mscale(factor, mscale_all_dim), both
    transformers' formulas. Without YaRN the scaling factor is irrelevant and mscale_all_dim 0 makes the scale 1.
    """
    yarn = shape.yarn
    settings = dict(
        multi_latent_attention=True, q_lora_rank=shape.q_lora_rank or None, kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_nope_dim, qk_pos_emb_head_dim=shape.qk_rope_dim, v_head_dim=shape.v_head_dim,
        num_query_groups=shape.heads, kv_channels=shape.v_head_dim, rotary_base=shape.rope_theta,
        rope_type="yarn" if yarn else "rope", mscale_all_dim=0.0,
    )
    if yarn:
        # without mscale and mscale_all_dim transformers scales cos/sin by mscale(factor, 1), which is Megatron's
        # ratio at mscale 1 and mscale_all_dim 0
        settings.update(rotary_scaling_factor=yarn.factor, mscale=yarn.mscale or 1.0,
                        mscale_all_dim=yarn.mscale_all_dim or 0.0,
                        original_max_position_embeddings=yarn.original_max_position,
                        beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)
    return settings


def fused_kernels(*, te: bool) -> dict:
    """The TransformerConfig switches of Megatron's fused kernels for a GPU run, each on where this install has
    its kernel (`te`: the layers are Transformer Engine's). Megatron's dataclass leaves them all off and its
    own training scripts turn them on; a recipe's `model.megatron` overrides any of them.

    - `bias_activation_fusion`: SwiGLU forward and backward in one compiled kernel each (Megatron's
      torch.compile'd function: needs only torch), instead of a chunk, a SiLU and a product over the largest
      activation of the layer, each a pass over memory.
    - `bias_dropout_fusion`: the residual add of attention and MLP outputs, compiled the same way.
    - `apply_rope_fusion`: rotary embeddings in one Transformer Engine kernel, for padded and packed sequences.
    - `gradient_accumulation_fusion`: every linear layer's backward adds its weight gradient into DDP's fp32
      gradient buffer with one GEMM, instead of writing a weight-sized gradient that DDP then adds: one weight
      -sized tensor and a pass over it less per layer and micro-batch. Megatron's own linear layers (the
      output layer, and every layer without Transformer Engine) take apex's `fused_weight_gradient_mlp_cuda`
      for it and refuse the switch without that extension, so it is on only where apex was built with it.
    """
    from megatron.core.models.common.embeddings import rope_utils

    rope = rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb_thd is not None
    return dict(bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=te and rope,
                gradient_accumulation_fusion=has_apex_wgrad_kernel())


def has_apex_wgrad_kernel() -> bool:
    """apex's CUDA extension for gradient accumulation fusion (`--cuda_ext` builds it) imports: Megatron's own
    flag, which its linear layers check before they accept the switch."""
    from megatron.core.tensor_parallel import layers

    return layers._grad_accum_fusion_available


def uses_transformer_engine() -> bool:
    """Whether Transformer Engine's layers are usable here: TE imports and a GPU is present. A run's models use
    them unless the run needs the local spec (megarl.job resolves which, once, for all of its models)."""
    if not on_gpu():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt(shape: ModelShape, config, *, groups: ParallelGroups, vp_stage: int | None = None,
              lora: LoraConfig | None = None, te_layers: bool = False):
    """One GPTModel chunk of this pipeline stage (weights uninitialized): the whole stage, or with virtual
    pipeline stages the chunk of virtual stage `vp_stage`, whose layers Megatron picks from the config;
    `te_layers`: Transformer Engine's layer spec, else Megatron's local one; with `lora`, adapters on the targeted
    linears (megarl.engine.lora, local spec only)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    from megarl.engine.local_attention import rope_at_position_ids

    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(shape, config, groups=groups, vp_stage=vp_stage, lora=lora,
                                           te_layers=te_layers),
        vocab_size=padded_vocab_size(shape.vocab_size, tp=groups.tp_size),
        max_sequence_length=shape.max_position,
        pre_process=groups.pp_rank == 0 and is_vp_first_stage(vp_stage, config.virtual_pipeline_model_parallel_size),
        post_process=groups.is_pp_last and is_vp_last_stage(vp_stage, config.virtual_pipeline_model_parallel_size),
        parallel_output=True, share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="yarn" if shape.yarn is not None and not shape.mla else "rope",
        rotary_base=int(shape.rope_theta), rotary_percent=shape.rotary_fraction,
        rope_scaling=shape.llama3_rope_factor is not None,
        rope_scaling_factor=shape.llama3_rope_factor or 8.0, vp_stage=vp_stage,
        seq_len_interpolation_factor=shape.rope_linear_factor,
    )
    rope_at_position_ids(model)  # shared-prompt rows (megarl.packing.shared_row)
    if shape.attention_sinks:
        split_sinks_over_tp(model)
    if shape.post_norms:
        from megarl.engine import gemma

        gemma.adapt_model(model, shape)
    if on_gpu():
        model.cuda(current_device())
    return model


def _block_spec(shape: ModelShape, config, *, groups: ParallelGroups, vp_stage: int | None,
                lora: LoraConfig | None, te_layers: bool):
    """The layers of this chunk and the final norm: one spec per layer, MoE models' dense first layers
    (shape.dense_layers) with a dense MLP, Gemma 3's with norms on the attention and MLP outputs too."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megarl.engine import gemma

    if te_layers:  # zero-centred norms are TE's own, through the config (gemma.transformer_fields)
        from megatron.core.extensions.transformer_engine import TENorm as norm

        layer_spec = functools.partial(_te_layer_spec, shape, config)
    else:
        from megarl.engine.rms_norm import RMSNorm

        norm = gemma.ZeroCenteredRMSNorm if shape.zero_centered_norms else RMSNorm
        layer_spec = functools.partial(_local_layer_spec, shape, lora=lora, norm=norm)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=groups.pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=groups.pp_rank)
    kinds = [shape.experts if shape.is_moe_layer(first + i) else None for i in range(count)]
    specs = {experts: layer_spec(experts) for experts in set(kinds)}
    if shape.post_norms:
        specs = {experts: gemma.post_norm_layer(spec, norm) for experts, spec in specs.items()}
    return TransformerBlockSubmodules(layer_specs=[specs[experts] for experts in kinds], layer_norm=norm)


def _te_layer_spec(shape: ModelShape, config, experts: int | None):
    """Transformer Engine's layer spec, with `experts` routed experts (None: a dense MLP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megarl.engine.te_attention import SharedPromptTEAttention

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                                      qk_layernorm=shape.qk_norm or shape.mla,
                                                      multi_latent_attention=shape.mla)
    # TE's core attention, which also takes shared-prompt rows (train.share_prompts)
    spec.submodules.self_attention.submodules.core_attention = SharedPromptTEAttention
    return spec


def _local_layer_spec(shape: ModelShape, experts: int | None, *, lora: LoraConfig | None, norm):
    """Megatron's local layer spec, with `experts` routed experts (None: a dense MLP) and `norm` for its norms
    (megarl's RMSNorm, or Gemma's zero-centred one), as megarl runs it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megarl.engine.local_attention import PackedLocalAttention

    layer = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                     qk_layernorm=shape.qk_norm or shape.mla, normalization="RMSNorm",
                                     multi_latent_attention=shape.mla)
    attention = layer.submodules.self_attention.submodules
    # The local core attention refuses packed sequences; this one masks them block-diagonally.
    attention.core_attention = PackedLocalAttention
    # Megatron's torch norm wrapper refuses sequence parallelism; megarl's norms take it (and are the same
    # function and parameter otherwise). The final norm is the block's, so the block is spelled out.
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    if shape.mla:
        from megatron.core.post_training.modelopt.layers import Linear

        # The down-projections whole on every TP rank, as Transformer Engine's spec has them ("duplicated"), not
        # column-split: split, Megatron gathers their output over TP, and the shared RoPE key's gradient then keeps
        # only this rank's heads' share (measured: wrong updates at TP = 2). Whole, under sequence parallelism,
        # the key is gathered over the sequence, whose backward sums every rank's share, and the weights'
        # gradients are summed over TP (tagged sequence_parallel).
        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
        # the query and key/value latents, split over the sequence like the hidden states they come from
        attention.q_layernorm = attention.kv_layernorm = norm
    elif shape.qk_norm:
        attention.q_layernorm = attention.k_layernorm = ModuleSpec(module=norm, params={"sequence_split": False})
    if shape.linear_bias and experts:
        from megarl.engine.local_experts import ExpertBiasRowParallelLinear

        layer.submodules.mlp.submodules.experts.submodules.linear_fc2 = ExpertBiasRowParallelLinear
    if lora is not None:
        adapters.adapt_layer_spec(layer, lora)
    return layer


def split_sinks_over_tp(model) -> None:
    """Tag the attention sinks (the core attention's `softmax_offset`, one per head of this rank) as split over
    the tensor-parallel ranks on dim 0, as Megatron's checkpoint sharding of them says: the weight gathers and the
    gradient norm read the tag, which Megatron's core attention does not set."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset") and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)


def global_name(local_name: str, layer_offset: int) -> str:
    """Megatron names layers per pipeline stage from 0; the name table uses global indices."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


# Transformer Engine's grouped expert linears (TEGroupedLinear: `mlp.experts.linear_fc2.weight{e}`). With etp > 1
# or ep > 1 Megatron builds them without a TE parallel mode (its MoE dispatcher does the communication), and TE
# then tags every weight{e} with partition_dim 0, the row-parallel fc2's too. fc2 is split on its input dim 1,
# as Megatron's own checkpoint sharding of TERowParallelGroupedLinear says.
_GROUPED_FC2 = re.compile(r"(^|\.)mlp\.experts\.linear_fc2\.weight\d+$")


def tp_split(name: str, param: Tensor) -> int | None:
    """The dim along which parameter `name` is split over the tensor-parallel ranks (a routed expert's: the expert
    tensor-parallel ranks); None if every rank holds it whole."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return 1 if _GROUPED_FC2.search(name) else param.partition_dim


class ValueHead(torch.nn.Module):
    """A scalar head in place of GPTModel's output layer: hidden [s, b, h] -> values [s, b, 1].

    Called the way GPTModel calls its output layer. The weight is replicated across tensor-parallel
    ranks, like a norm weight, so Megatron counts it once in the gradient norm and DDP averages it over
    data-parallel ranks only. Under sequence parallelism (`sequence_parallel_group`, the TP group) the
    hidden states are this rank's slice of the sequence [s / tp, b, h]: the slice's values are all-gathered
    to [s, b, 1] (every TP rank computes the same loss from them, so the backward only hands each rank its
    slice's gradient), and the weight, tagged `sequence_parallel`, gets its slices' gradients summed over TP
    by Megatron's finalize_model_grads.
    """

    def __init__(self, hidden: int, dtype: torch.dtype, *, sequence_parallel_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=current_device()))
        self.weight.sequence_parallel = sequence_parallel_group is not None
        self.sequence_parallel_group = sequence_parallel_group

    def forward(self, hidden_states: Tensor, weight=None, runtime_gather_output=None) -> tuple[Tensor, None]:
        values = F.linear(hidden_states, self.weight)
        if self.sequence_parallel_group is not None:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.sequence_parallel_group)
        return values, None


@dataclass
class StageModel:
    """This rank's share of one model: the GPTModel chunks of its pipeline stage (one per virtual stage, in
    the order the interleaved schedule visits them; the last one of the last stage holds the head), the
    shape and Megatron config they were built from, and how their parameters are named globally."""

    shape: ModelShape
    config: object                 # megatron.core.transformer.TransformerConfig
    groups: ParallelGroups
    chunks: list                   # GPTModel per virtual pipeline stage of this rank
    layer_offsets: list[int]       # global index of each chunk's first layer
    names: NameTable               # Megatron <-> HF names
    value_head: bool               # a scalar head instead of the vocabulary projection (critic, reward model)
    lora: LoraConfig | None = None  # low-rank adapters on the linears (megarl.engine.lora); None: none

    @property
    def expert_offset(self) -> int:
        """Expert-parallel rank r holds the experts r * experts_per_rank ... (r + 1) * experts_per_rank - 1."""
        return self.groups.ep_rank * (self.shape.experts // self.groups.ep_size)

    @property
    def module(self):
        """The GPTModel of a stage without virtual pipeline stages."""
        return only_chunk(self.chunks)

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """(name with the global layer index, parameter) of every chunk on this rank: the model's own, which
        HF checkpoints hold (the routers' expert bias buffers included: `named_weights`), without the LoRA
        adapters (`adapted_layers`)."""
        for chunk, offset in zip(self.chunks, self.layer_offsets):
            for local_name, param in named_weights(chunk):
                if not adapters.is_adapter(local_name):
                    yield global_name(local_name, offset), param

    def adapted_layers(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """(module name with the global layer index, layer) of every linear with a LoRA adapter on this rank."""
        for chunk, offset in zip(self.chunks, self.layer_offsets):
            for local_name, module in chunk.named_modules():
                if hasattr(module, "adapter_on"):
                    yield global_name(local_name, offset), module


def named_weights(module: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """`module`'s parameters, then the expert bias buffers of its sigmoid routers (`mlp.router.expert_bias`,
    float32): HF checkpoints hold them (`e_score_correction_bias`), loads and pushes carry them, no optimizer
    steps them."""
    yield from module.named_parameters()
    for name, buffer in module.named_buffers():
        if name.endswith(".router.expert_bias"):
            yield name, buffer


def only_chunk(chunks: list):
    """The one model chunk (GPTModel, or its DDP wrapper) of a stage without virtual pipeline stages."""
    if len(chunks) > 1:
        raise AttributeError(f"this engine holds {len(chunks)} model chunks (virtual pipeline stages): "
                             "use `chunks` / `models`")
    return chunks[0]


def build_stage_model(shape: ModelShape, *, dtype: str, megatron: dict, groups: ParallelGroups,
                      value_head: bool, lora: LoraConfig | None = None, te_layers: bool | None = None) -> StageModel:
    """This rank's chunks of a model of `shape`, weights uninitialized (megarl.engine.hf_weights.load_hf fills
    them). A critic's (`value_head`) embeddings are never tied. `lora`: adapters on the policy's linears,
    ValueError where they cannot be built. `te_layers`: Transformer Engine's layer spec (None: wherever it is
    usable)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    te = uses_transformer_engine() if te_layers is None else te_layers
    if value_head:
        shape = dataclasses.replace(shape, tied_embeddings=False)
    config = transformer_config(shape, dtype=dtype, tp=groups.tp_size, pp=groups.pp_size, ep=groups.ep_size,
                                etp=groups.etp_size, cp=groups.cp_size, megatron=megatron, te_layers=te)
    vpp = config.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    if lora is not None:
        check_lora(lora, shape, te=te, value_head=value_head, etp=groups.etp_size)
    chunks = [build_gpt(shape, config, groups=groups, vp_stage=v, lora=lora, te_layers=te) for v in stages]
    if value_head and groups.is_pp_last:
        sp_group = groups.tp if config.sequence_parallel else None
        chunks[-1].output_layer = ValueHead(shape.hidden, config.params_dtype, sequence_parallel_group=sp_group)
    return StageModel(shape=shape, config=config, groups=groups, chunks=chunks,
                      layer_offsets=[get_transformer_layer_offset(config, vp_stage=v) for v in stages],
                      names=NameTable(name_rules(shape, te_spec=te)), value_head=value_head,
                      lora=lora)
