"""The Megatron-core train engine: a GPTModel built from a HuggingFace checkpoint directory.

This module is the only one that reads Megatron's global `parallel_state`; it hands explicit process
groups (`ParallelGroups`) to everything else. One `TrainEngine` is one model (actor, reference or, later,
critic) with its HF weights loaded directly from safetensors, token logprobs through the vocab-parallel
cross entropy, and training through Megatron DDP, `get_megatron_optimizer` and
`get_forward_backward_func`.

Sequences are [B, T] token ids, right padded. Logprobs are aligned with the tokens: `logprobs[b, t]` is
log p(tokens[b, t] | tokens[b, :t]) at the sampling temperature, and column 0 is 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megarl.checkpoint import CheckpointError
from megarl.config import RecipeError
from megarl.engine.context_parallel import gather_sequence, split_sequence
from megarl.engine.offload import TrainerMemory
from megarl.models import layout
from megarl.models.arch import ModelShape, check_layout, check_virtual_stages, padded_vocab_size, read_shape
from megarl.models.names import NameTable, name_rules
from megarl.models.safetensors_dir import SafetensorsDir
from megarl.packing import count_bins, pack, packed_row, plan_micro_batches, unpack

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# How optimizer state is laid out in distributed checkpoints: "fully_reshardable" is the format that loads
# at a different TP/PP/EP/DP layout (the default "fully_sharded_model_space" fails to save on gloo).
_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Parameters with one row per (padded) vocabulary entry: padded on load, truncated on export.
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
# A loss function sees one micro-batch: the head's output [b, T] (logprobs, or values of a critic) and
# that micro-batch's slice of every extra tensor; it returns its contribution to the global loss and to
# each summed statistic.
LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups and ranks handed to the rest of megarl (None group = a size-1 axis)."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    mp: dist.ProcessGroup          # tensor x context x pipeline: the ranks of one data-parallel replica
    ep: dist.ProcessGroup          # expert parallel: the ranks that split one layer's experts between them
    cp: dist.ProcessGroup          # context parallel: the ranks that split every sequence between them
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int
    ep_size: int
    cp_rank: int
    cp_size: int
    pp_last_global_rank: int       # global rank of the last pipeline stage of this rank's pipeline
    mp_src_global_rank: int        # global rank of this replica's first rank (the one that feeds rollout)

    @property
    def is_pp_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_parallel(*, tp: int, pp: int, ep: int = 1, cp: int = 1, seed: int = 0) -> ParallelGroups:
    """Initialize torch.distributed (torchrun env, else a one-process group) and Megatron's parallel state."""
    cuda = torch.cuda.is_available()
    if not cuda:
        from megarl.engine import cpu_compat

        cpu_compat.load_cuda_driver_stand_in()  # before megatron's imports, which may load CUDA kernels
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        if "RANK" in os.environ:
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if cuda else "gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not cuda:
        cpu_compat.install()
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, expert_model_parallel_size=ep)
    current = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_expert_model_parallel_world_size(), ps.get_context_parallel_world_size())
    if current != (tp, pp, ep, cp):
        raise RuntimeError(f"Megatron's parallel state is already initialized with tp, pp, ep, cp = {current}, "
                           f"not the requested {(tp, pp, ep, cp)}")
    tp_ranks = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    # Experts are split over Megatron's expert tensor-parallel group (default size tp); its rank generator
    # also puts tp innermost, so it holds the TP group's ranks and the weight gathers can use groups.tp.
    if dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group()) != tp_ranks:
        raise RuntimeError("Megatron's expert tensor-parallel group differs from the tensor-parallel group")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    replica = ps.get_model_parallel_group()
    if cp > 1:
        # Megatron's model-parallel group (tensor x pipeline) leaves context parallelism out, its ranks hold
        # the same weights; but context-parallel ranks also share one rollout batch and one rollout engine,
        # so `mp` here is the whole replica: the ranks of one data-parallel index. Every rank creates every
        # group, in the same order.
        dp_of_rank: list[int | None] = [None] * world
        dist.all_gather_object(dp_of_rank, ps.get_data_parallel_rank())
        for index in sorted(set(dp_of_rank)):
            group = dist.new_group([r for r, d in enumerate(dp_of_rank) if d == index])
            if index == ps.get_data_parallel_rank():
                replica = group
    return ParallelGroups(
        tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
        dp=ps.get_data_parallel_group(), mp=replica,
        ep=ps.get_expert_model_parallel_group(), cp=ps.get_context_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep,
        cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
        pp_last_global_rank=pp_ranks[-1], mp_src_global_rank=min(dist.get_process_group_ranks(replica)),
    )


def transformer_config(shape: ModelShape, *, dtype: str, tp: int, pp: int, megatron: dict, ep: int = 1,
                       cp: int = 1):
    """Megatron TransformerConfig for an HF architecture; `megatron` holds extra fields from the recipe."""
    from megatron.core.transformer import TransformerConfig

    check_megatron_fields(megatron)
    comm = megatron.get("cp_comm_type")
    if cp > 1 and (comm == "a2a+p2p" or isinstance(comm, list) and "a2a+p2p" in comm):
        # the hierarchical exchange needs hierarchical_context_parallel_sizes at parallel-state init
        raise RecipeError("model.megatron.cp_comm_type = 'a2a+p2p' (hierarchical context parallelism) is not "
                          "supported; use 'p2p', 'all_gather' or 'a2a'")
    torch_dtype = _DTYPES[dtype]
    kwargs = dict(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", layernorm_epsilon=shape.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=cp,
        params_dtype=torch_dtype, pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16, fp16=torch_dtype == torch.float16,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # Initialization is overwritten by the checkpoint, but it is also what tags each weight with its
        # tensor-parallel split (`tensor_model_parallel`, `partition_dim`), which grad-norm and the
        # weight gathers rely on.
        perform_initialization=True, use_cpu_initialization=not torch.cuda.is_available(),
    )
    if shape.is_moe:
        kwargs.update(_moe_config(shape))
    if not torch.cuda.is_available():
        # Fused kernels are CUDA code; their unfused twins compute the same function.
        kwargs.update(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                      persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    vpp = megatron.get("virtual_pipeline_model_parallel_size") or 1
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
    elif pp == 2 and kwargs["batch_p2p_comm"] and not torch.cuda.is_available():
        raise RecipeError("model.megatron.batch_p2p_comm: true with virtual pipeline stages and parallel.pp = 2 "
                          "mixes up activations and gradients on gloo (both go to the same peer); leave it unset")
    return TransformerConfig(**kwargs)


def _moe_config(shape: ModelShape) -> dict:
    """TransformerConfig MoE fields that route exactly as transformers does (megarl.models.arch).

    Megatron's default router takes the top-k logits and softmaxes over those k: the renormalized top-k
    probabilities of `norm_topk`. Without renormalization, `moe_router_pre_softmax` softmaxes over all
    experts before the top-k. Dropless (no capacity factor): every token reaches its k experts, as in HF.
    """
    return dict(
        num_moe_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.moe_ffn,
        moe_router_pre_softmax=not shape.norm_topk, moe_router_score_function="softmax",
        moe_shared_expert_intermediate_size=shape.shared_ffn or None, moe_shared_expert_gate=shape.shared_ffn > 0,
        # Switch-Transformer load balancing per micro-batch, summed over layers; HF adds it only when
        # `output_router_logits` and over all layers' tokens at once (and with top-k times Megatron's scale),
        # so the coefficient means the same strength only roughly. A recipe can override it (model.megatron).
        moe_router_load_balancing_type="aux_loss" if shape.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=shape.aux_loss_coeff, moe_expert_capacity_factor=None,
        # Grouped GEMM needs the CUDA-only grouped_gemm / Transformer Engine kernels.
        moe_grouped_gemm=uses_transformer_engine(),
    )


def check_megatron_fields(megatron: dict) -> None:
    """The recipe's `model.megatron` keys must be TransformerConfig fields the engine can honour."""
    from megatron.core.transformer import TransformerConfig

    unknown = sorted(set(megatron) - {f.name for f in dataclasses.fields(TransformerConfig)})
    if unknown:
        raise RecipeError(f"model.megatron: unknown TransformerConfig field(s): {', '.join(unknown)}")
    vpp = megatron.get("virtual_pipeline_model_parallel_size")
    if vpp is not None and (type(vpp) is not int or vpp < 1):
        raise RecipeError(f"model.megatron.virtual_pipeline_model_parallel_size = {vpp!r}: the number of virtual "
                          "pipeline stages per pipeline rank must be a whole number >= 1")


def uses_transformer_engine() -> bool:
    """Transformer Engine layers when TE imports and a GPU is present; the local spec otherwise."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt(shape: ModelShape, config, *, groups: ParallelGroups, vp_stage: int | None = None):
    """One GPTModel chunk of this pipeline stage (weights uninitialized): the whole stage, or with virtual
    pipeline stages the chunk of virtual stage `vp_stage`, whose layers Megatron picks from the config."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    experts = shape.experts or None
    if uses_transformer_engine():
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                                          qk_layernorm=shape.qk_norm)
    else:
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        from megarl.engine.local_attention import PackedLocalAttention
        from megarl.engine.rms_norm import RMSNorm

        layer = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm,
                                         normalization="RMSNorm")
        attention = layer.submodules.self_attention.submodules
        # The local core attention refuses packed sequences; this one masks them block-diagonally.
        attention.core_attention = PackedLocalAttention
        # Megatron's torch norm wrapper refuses sequence parallelism; megarl's RMSNorm takes it (and is the
        # same function and parameter otherwise). The final norm is the block's, so the block is spelled out.
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
        if shape.qk_norm:
            attention.q_layernorm = attention.k_layernorm = ModuleSpec(module=RMSNorm,
                                                                       params={"sequence_split": False})
        layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=groups.pp_rank)
        spec = TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=RMSNorm)
    model = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(shape.vocab_size, tp=groups.tp_size),
        max_sequence_length=shape.max_position,
        pre_process=groups.pp_rank == 0 and is_vp_first_stage(vp_stage, config.virtual_pipeline_model_parallel_size),
        post_process=groups.is_pp_last and is_vp_last_stage(vp_stage, config.virtual_pipeline_model_parallel_size),
        parallel_output=True, share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope", rotary_base=int(shape.rope_theta),
        rope_scaling=shape.llama3_rope_factor is not None,
        rope_scaling_factor=shape.llama3_rope_factor or 8.0, vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def _global_name(local_name: str, layer_offset: int) -> str:
    """Megatron names layers per pipeline stage from 0; the name table uses global indices."""
    parts = local_name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def _tp_split(param: Tensor) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


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
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=_device()))
        self.weight.sequence_parallel = sequence_parallel_group is not None
        self.sequence_parallel_group = sequence_parallel_group

    def forward(self, hidden_states: Tensor, weight=None, runtime_gather_output=None) -> tuple[Tensor, None]:
        values = F.linear(hidden_states, self.weight)
        if self.sequence_parallel_group is not None:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.sequence_parallel_group)
        return values, None


# HF sequence-classification checkpoints (reward models) name their scalar head this way.
_HF_SCORE = "score.weight"


class TrainEngine:
    """One Megatron model (actor, reference or critic) over this rank's share of the parallel layout.

    With `optim` None the model is frozen (reference): no DDP wrapper, no optimizer, no gradients.
    `value_head=True` makes a critic: the vocabulary projection is replaced by a scalar head, read from
    the checkpoint's `score.weight` when it has one (a reward model) and zero otherwise, so every value
    starts at 0.

    With virtual pipeline stages (`model.megatron.virtual_pipeline_model_parallel_size`) this rank holds
    one model chunk per virtual stage (`chunks`, `models`) and runs Megatron's interleaved schedule;
    weights, handoff and checkpoints name every layer by its global index either way.
    """

    def __init__(self, *, model_dir: str, dtype: str, megatron: dict, groups: ParallelGroups, optim=None,
                 value_head: bool = False, load_weights: bool = True):
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        self.groups = groups
        self.shape = read_shape(model_dir)
        if value_head:
            self.shape = dataclasses.replace(self.shape, tied_embeddings=False)
        self.config = transformer_config(self.shape, dtype=dtype, tp=groups.tp_size, pp=groups.pp_size,
                                         ep=groups.ep_size, cp=groups.cp_size, megatron=megatron)
        vpp = self.config.virtual_pipeline_model_parallel_size
        stages = [None] if vpp is None else list(range(vpp))
        # in the order the interleaved schedule visits them; the last one of the last stage holds the head
        self.chunks = [build_gpt(self.shape, self.config, groups=groups, vp_stage=v) for v in stages]
        self.value_head = value_head
        if value_head and groups.is_pp_last:
            sp_group = groups.tp if self.config.sequence_parallel else None
            self.chunks[-1].output_layer = ValueHead(self.shape.hidden, self.config.params_dtype,
                                                     sequence_parallel_group=sp_group)
        self.names = NameTable(name_rules(self.shape, te_spec=uses_transformer_engine()))
        self._layer_offsets = [get_transformer_layer_offset(self.config, vp_stage=v) for v in stages]
        # Expert-parallel rank r holds the experts r * experts_per_rank ... (r + 1) * experts_per_rank - 1.
        self._expert_offset = groups.ep_rank * (self.shape.experts // groups.ep_size)
        if load_weights:  # False: the weights come from a distributed checkpoint (`load_checkpoint`)
            self.load_hf(model_dir)
        if optim is None:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
                chunk.eval()
            self.models, self.optimizer = self.chunks, None
        else:
            self.models, self.optimizer = self._wrap_for_training(optim)
        self.memory = TrainerMemory(self.chunks, self.models if optim is not None else None, self.optimizer)
        self.step = 0

    @property
    def module(self):
        """The GPTModel of an engine without virtual pipeline stages."""
        return self._only(self.chunks)

    @property
    def model(self):
        """`module`, wrapped in Megatron DDP when the engine trains."""
        return self._only(self.models)

    @staticmethod
    def _only(chunks: list):
        if len(chunks) > 1:
            raise AttributeError(f"this engine holds {len(chunks)} model chunks (virtual pipeline stages): "
                                 "use `chunks` / `models`")
        return chunks[0]

    def _named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """(name with the global layer index, parameter) of every chunk on this rank."""
        for chunk, offset in zip(self.chunks, self._layer_offsets):
            for local_name, param in chunk.named_parameters():
                yield _global_name(local_name, offset), param

    # ---- weights ----------------------------------------------------------------------------------
    def load_hf(self, model_dir: str | Path) -> None:
        """Copy an HF checkpoint into this rank's shards. Every Megatron parameter must be covered."""
        source = SafetensorsDir(model_dir)
        with torch.no_grad():
            for name, param in self._named_parameters():
                shard = self._hf_shard(source, name, param)
                if shard is not None:
                    param.copy_(shard)

    def _hf_shard(self, source: SafetensorsDir, name: str, param: Tensor) -> Tensor | None:
        """This rank's shard of parameter `name` (global layer index; shaped like `param`, which may be on the
        meta device), made from the HF tensors it is built of; None for a critic's value head the checkpoint
        has no `score.weight` for (it keeps its zeros)."""
        if self.value_head and name == "output_layer.weight":
            return source.get(_HF_SCORE).reshape(param.shape) if _HF_SCORE in source else None
        if name == "output_layer.weight" and self.shape.tied_embeddings:
            hf_names = ("model.embed_tokens.weight",)  # last pipeline stage's copy of tied weights
            rule_fuse = None
        else:
            rule, _, _ = self.names.lookup(name)
            hf_names, rule_fuse = self.names.hf_names(name, expert_offset=self._expert_offset), rule.fuse
        full = self._fuse([source.get(n) for n in hf_names], rule_fuse)
        if name in _VOCAB_PARAMS:
            full = _pad_rows(full, param.shape[0] * self.groups.tp_size)
        shard = layout.shard(full, dim=_tp_split(param), rank=self.groups.tp_rank,
                             size=self.groups.tp_size, gate_up=rule_fuse == "gate_up")
        if shard.shape != param.shape:
            raise ValueError(f"{source.model_dir}: {hf_names} gives shape {tuple(shard.shape)} for {name}, "
                             f"expected {tuple(param.shape)}")
        return shard

    def _fuse(self, parts: list[Tensor], fuse: str | None) -> Tensor:
        match fuse:
            case None:
                return parts[0]
            case "qkv":
                return layout.join_qkv(*parts, groups=self.shape.kv_heads, head_dim=self.shape.head_dim)
            case "gate_up":
                return layout.join_gate_up(*parts)
        raise ValueError(f"unknown fused layout {fuse!r}")

    def hf_tensors(self, *, checkpoint: str | Path | None = None,
                   bucket_bytes: int = 2**30) -> Iterator[tuple[str, Tensor]]:
        """Full HF-named tensors of this model, one at a time (TP shards all-gathered, experts gathered
        over the expert-parallel group with their global indices).

        Every rank of a pipeline stage takes part in the gathers; every rank yields the full tensors of
        its own stage's layers, every expert included, so the rank that feeds a rollout engine must also
        receive the other stages' tensors (`pipeline_hf_tensors`).

        With `checkpoint`, the weights are read from that distributed checkpoint about `bucket_bytes` at a
        time instead of from the module, which may then live on the meta device (`meta_engine`): memory
        holds one bucket, whatever the model size. A checkpoint of another model is a CheckpointError.
        """
        if self.value_head:
            raise ValueError("a critic is not a causal LM: its weights have no HF causal-LM export")
        ep_ranks = dist.get_process_group_ranks(self.groups.ep)
        experts_per_rank = self.shape.experts // self.groups.ep_size
        params = ((n, p, p.detach()) for n, p in self._named_parameters()) if checkpoint is None \
            else self._checkpoint_params(Path(checkpoint), bucket_bytes=bucket_bytes)
        for name, param, data in params:
            if name == "output_layer.weight" and self.shape.tied_embeddings:
                continue
            rule, _, expert = self.names.lookup(name)
            dim = _tp_split(param)
            if dim is not None and self.groups.tp_size > 1:
                shards = [torch.empty_like(data) for _ in range(self.groups.tp_size)]
                dist.all_gather(shards, data.contiguous(), group=self.groups.tp)
                data = layout.unshard(shards, dim=dim, gate_up=rule.fuse == "gate_up")
            if name in _VOCAB_PARAMS:
                data = data[: self.shape.vocab_size]
            if expert is None:
                yield from zip(self.names.hf_names(name), self._split(data, rule.fuse))
                continue
            # Every EP rank holds this local expert slot for a different global expert: each rank in turn
            # broadcasts its copy, so no rank holds more than one extra expert tensor at a time.
            for ep_rank, src in enumerate(ep_ranks):
                copy = data
                if self.groups.ep_size > 1:
                    copy = data.contiguous() if ep_rank == self.groups.ep_rank else torch.empty_like(data)
                    dist.broadcast(copy, src=src, group=self.groups.ep)
                yield from zip(self.names.hf_names(name, expert_offset=ep_rank * experts_per_rank),
                               self._split(copy, rule.fuse))

    def _split(self, full: Tensor, fuse: str | None) -> tuple[Tensor, ...]:
        match fuse:
            case None:
                return (full,)
            case "qkv":
                return layout.split_qkv(full, groups=self.shape.kv_heads, head_dim=self.shape.head_dim)
            case "gate_up":
                return layout.split_gate_up(full)
        raise ValueError(f"unknown fused layout {fuse!r}")

    def pipeline_hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """`hf_tensors` of every pipeline stage, delivered in stage order to every rank of the pipeline.

        Each stage in turn sends its tensors one at a time over the pipeline group (a name broadcast,
        then the tensor), so no rank ever holds more than one extra full tensor.
        """
        if self.groups.pp_size == 1:
            yield from self.hf_tensors()
            return
        pp_ranks = dist.get_process_group_ranks(self.groups.pp)
        for stage, src in enumerate(pp_ranks):
            mine = self.hf_tensors() if stage == self.groups.pp_rank else None
            while True:
                item = next(mine, None) if mine is not None else None
                header = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
                dist.broadcast_object_list(header, src=src, group=self.groups.pp)
                if header[0] is None:
                    break
                name, shape, dtype = header[0]
                tensor = item[1].contiguous() if item is not None else torch.empty(
                    shape, dtype=dtype, device=_device())
                dist.broadcast(tensor, src=src, group=self.groups.pp)
                yield name, tensor

    # ---- training setup -----------------------------------------------------------------------------
    def _wrap_for_training(self, optim):
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=optim.distributed)
        ddps = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk)
                for chunk in self.chunks]
        opt_config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.beta1,
            adam_beta2=optim.beta2, adam_eps=optim.eps, clip_grad=optim.grad_clip,
            bf16=self.config.bf16, fp16=self.config.fp16, params_dtype=self.config.params_dtype,
            use_distributed_optimizer=optim.distributed,
        )
        # one optimizer over every chunk: one gradient norm, one clipping, one step
        optimizer = get_megatron_optimizer(opt_config, ddps)
        self.config.finalize_model_grads_func = finalize_model_grads
        # the interleaved schedule takes one no_sync per chunk, the others a single one
        self.config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [ddp.no_sync for ddp in ddps]
        return ddps, optimizer

    # ---- device memory choreography (co-located rollout) ------------------------------------------------
    # On GPU the trainer gives its device memory to the rollout engine between updates (megarl.engine.offload);
    # on CPU there is nothing to give back and these are no-ops, logged once.
    def offload_training_state(self) -> None:
        """Free gradient buffers and move optimizer state to the host (GPU only)."""
        self.memory.offload_training_state()

    def offload_params(self) -> None:
        """Move parameters to pinned host memory (GPU only); `onload` brings everything back."""
        self.memory.offload_params()

    def onload(self) -> None:
        """Bring parameters, gradient buffers and optimizer state back to the device (GPU only)."""
        self.memory.onload()

    # ---- distributed checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, *, hf_dir: str | Path | None = None,
                        progress: Callable[[], object] | None = None) -> None:
        """Model (and optimizer) state as a Megatron distributed checkpoint in directory `path`, written by
        every rank of the job collectively. The optimizer state is saved fully reshardable, so the
        checkpoint loads at any TP, PP, EP or DP layout.

        With `hf_dir` (a model without optimizer), the weights are read from that HF checkpoint as the
        writer reaches each one instead of from the module, which may then live on the meta device
        (`meta_engine`): memory holds about one tensor, whatever the model size. `progress()` is called
        after each tensor (chunk) is written."""
        from megatron.core import dist_checkpointing

        Path(path).mkdir(parents=True, exist_ok=True)  # Megatron writes into an existing, empty directory
        if hf_dir is None:
            state = self._sharded_state(is_loading=False)
            dist_checkpointing.save(state, str(path), content_metadata=_CHECKPOINT_METADATA)
            return
        from megarl.engine.lazy_checkpoint import LazySave

        if self.optimizer is not None:
            raise ValueError("save_checkpoint(hf_dir=...) writes weights only; this engine has an optimizer")
        # one model chunk (the conversion tools build no virtual stages); the files name tensors by their
        # global keys, so the checkpoint loads into any number of chunks
        state = {"model": self.module.sharded_state_dict()}
        source, params = SafetensorsDir(hf_dir), dict(self.module.named_parameters())

        def resolve(local_name: str) -> Tensor:
            name = _global_name(local_name, self._layer_offsets[0])
            return self._hf_shard(source, name, params[local_name]).to(params[local_name].dtype)

        dist_checkpointing.save(state, str(path), sharded_strategy=LazySave(resolve, progress=progress),
                                content_metadata=_CHECKPOINT_METADATA)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what `save_checkpoint` wrote, whatever layout wrote it (a frozen or converted model
        takes the model part of a checkpoint that also holds optimizer state). A checkpoint of another
        architecture or size is an error listing the tensors that do not match; nothing is loaded then."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        self._fill_empty_adam_state()
        state = self._sharded_state(is_loading=True)
        _check_checkpoint(Path(path), state["model"])
        strict = StrictHandling.RAISE_ALL if self.optimizer is not None else StrictHandling.RAISE_UNEXPECTED
        loaded = dist_checkpointing.load(state, str(path), strict=strict)
        for chunk, chunk_state in zip(self.chunks, loaded["model"], strict=True):
            chunk.load_state_dict(chunk_state)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(loaded["optimizer"])

    def _checkpoint_params(self, path: Path, *, bucket_bytes: int) -> Iterator[tuple[str, Tensor, Tensor]]:
        """(name with the global layer index, parameter, its value on this rank read from checkpoint `path`)
        for every parameter, in module order, read a bucket of about `bucket_bytes` at a time (a larger
        tensor alone). An engine of one model chunk (`module`)."""
        from megarl.engine.lazy_checkpoint import read_parameters

        model_state = self.module.sharded_state_dict()
        _check_checkpoint(path, model_state)
        params = list(self.module.named_parameters())
        while params:
            bucket = [params.pop(0)]
            size = bucket[0][1].nbytes
            while params and size + params[0][1].nbytes <= bucket_bytes:
                size += params[0][1].nbytes
                bucket.append(params.pop(0))
            values = {name: torch.empty_like(param, device="cpu") for name, param in bucket}
            read_parameters(path, {name: model_state[name] for name, _ in bucket}, values)
            for name, param in bucket:
                yield _global_name(name, self._layer_offsets[0]), param, values.pop(name)

    def _fill_empty_adam_state(self) -> None:
        """Give a fresh torch Adam (the optimizer Megatron falls back to without apex or Transformer Engine)
        zero moments and a `step`, as it has after a real step. Megatron's own state initialization for
        loading leaves `step` out, and its distributed optimizer then fails reading it; the loaded
        checkpoint overwrites all three."""
        if self.optimizer is None:
            return
        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            torch_optimizer = inner.optimizer
            if not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
                continue
            for group in torch_optimizer.param_groups:
                for param in group["params"]:
                    if not torch_optimizer.state[param]:
                        torch_optimizer.state[param].update(
                            exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param),
                            step=torch.zeros((), dtype=torch.float32))

    def _sharded_state(self, *, is_loading: bool) -> dict:
        # One state dict per chunk. The tensors' keys in the checkpoint carry global layer indices (the dict
        # keys inside each chunk's state do not), so any number of chunks per rank loads any other.
        model_state = [chunk.sharded_state_dict() for chunk in self.chunks]
        state = {"model": model_state}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                                   metadata=_CHECKPOINT_METADATA)
        return state

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ---- compute ------------------------------------------------------------------------------------
    def _run(self, tokens: Tensor, extras: dict[str, Tensor], loss_fn: LossFn | None, *, temperature: float,
             micro_batch_size: int, forward_only: bool, entropy: bool = False, lengths: Tensor | None = None,
             micro_batch_tokens: int | None = None) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Run the pipeline schedule over micro-batches.

        The head's output per token, [b, T] (logprobs of an LM, values of a critic), goes to `loss_fn`
        (with `entropy=` [b, T] as well when asked). Returns (the outputs [B, T] when `loss_fn` is None or
        `forward_only`, else None; the loss function's statistics summed over micro-batches).

        Micro-batches hold `micro_batch_size` padded rows, or, with `micro_batch_tokens`, are packed rows
        of at most that many tokens (`lengths` [B], the real tokens of each row of `tokens`, is then
        required; see `_packed_micro_batches`). Loss functions see [b, T] tensors either way; packed
        outputs are 0 past each sequence's end.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = _device()
        batch, seq_len = tokens.shape
        width = seq_len
        cp = self.groups.cp_size
        if cp > 1 and micro_batch_tokens:
            raise ValueError(f"sequence packing (train.micro_batch_tokens = {micro_batch_tokens}) cannot be combined "
                             f"with context parallelism (parallel.cp = {cp}); turn one of them off")
        # Sequence parallelism splits every row evenly over TP ranks, context parallelism into 2 * cp chunks:
        # pad the columns (masked, so no loss sees them) and cut the outputs back.
        multiple = (self.groups.tp_size if self.config.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
        if not micro_batch_tokens and seq_len % multiple:
            width = -(-seq_len // multiple) * multiple
            def grow(t: Tensor) -> Tensor:
                return F.pad(t, (0, width - seq_len)) if t.dim() == 2 and t.shape[1] == seq_len else t

            tokens, extras = grow(tokens), {k: grow(v) for k, v in extras.items()}
        window = self.shape.sliding_window
        if window is not None and seq_len > window:
            # Megatron's attention here is full causal, which is the checkpoint's sliding-window attention
            # only while a sequence fits in the window (transformers masks nothing more until then).
            raise ValueError(f"sequence length {seq_len} exceeds the checkpoint's sliding_window {window}: "
                             "sliding-window attention is not supported beyond the window")
        if micro_batch_tokens:
            micro = self._packed_micro_batches(tokens, extras, lengths, micro_batch_tokens)
            shape_len, shape_batch = max(m[1].row_len for m in micro), 1
        else:
            if batch % micro_batch_size != 0:
                raise ValueError(f"batch of {batch} sequences is not divisible by micro_batch_size "
                                 f"{micro_batch_size}")
            cp_rank = self.groups.cp_rank
            positions = split_sequence(torch.arange(width, device=device)[None], cp=cp, rank=cp_rank)
            positions = positions.expand(micro_batch_size, -1)
            micro = []
            for i in range(0, batch, micro_batch_size):
                index = torch.arange(i, i + micro_batch_size)
                mb = {"tokens": tokens[index].to(device), **{k: v[index].to(device) for k, v in extras.items()}}
                # the token after each position, taken before the split: a context-parallel rank's last
                # position of a chunk predicts a token that another rank holds
                labels = F.pad(mb["tokens"][:, 1:], (0, 1))
                inputs = (split_sequence(mb["tokens"], cp=cp, rank=cp_rank),
                          split_sequence(labels, cp=cp, rank=cp_rank), positions, None)
                micro.append((index, None, inputs, mb))
            shape_len, shape_batch = width, micro_batch_size
        n_micro = len(micro)
        if self._schedulable(n_micro) != n_micro:
            group = self.config.microbatch_group_size_per_vp_stage
            raise ValueError(
                f"{batch} sequences in micro-batches of {micro_batch_size} (train.micro_batch_size) make {n_micro} "
                "micro-batches; the interleaved pipeline schedule (model.megatron.virtual_pipeline_model_parallel_"
                f"size = {self.config.virtual_pipeline_model_parallel_size}) needs at least {group} and a count "
                f"whose remainder modulo {group} (model.megatron.microbatch_group_size_per_vp_stage, default "
                f"parallel.pp) is 0 or at least parallel.pp = {self.groups.pp_size}, e.g. {self._schedulable(n_micro)}")
        chunks: list[tuple[Tensor, Tensor]] = []
        stat_sums: dict[str, Tensor] = {}
        # Megatron divides each micro-batch loss by the number of micro-batches and DDP averages over DP
        # ranks; loss functions here already return contributions normalized by global counts, so the
        # scale below undoes both averages and the gradient is exactly that of the global loss. Context
        # parallelism changes nothing here: every CP rank computes the loss of the whole sequences (their
        # outputs are gathered) and back-propagates it through its own positions only, so the CP ranks'
        # gradients add up to the full one; DDP averages over DP x CP ranks and the schedule multiplies
        # each loss by cp to match.
        # The MoE load-balancing loss is not returned here: each router attaches coeff * aux_loss of its
        # micro-batch to the autograd graph (MoEAuxLossAutoScaler), and the schedule scales its gradient by
        # 1 / n_micro, then DDP by 1 / dp. Its gradient is therefore that of coeff * (mean over the global
        # batch's micro-batches of each layer's aux loss), summed over layers: the same for every layout
        # that keeps the micro-batches (packing changes them), and part of grad_norm but not of the loss.
        loss_scale = float(n_micro * self.groups.dp_size)

        def aligned(per_position: Tensor) -> Tensor:
            """[b, s / cp] per position of this rank -> [b, s] whole sequences, shifted right by one: column t
            scores token t from the prefix before it (the value of the state before token t sits in column
            t, like the logprob of token t); column 0 is 0."""
            return F.pad(gather_sequence(per_position, group=self.groups.cp)[:, :-1], (1, 0))

        def loss_func(index, row, labels, mb, output):
            if self.value_head:
                out, kwargs = aligned(output[..., 0].float()), {}
            else:
                per_position, kwargs = self._token_logprobs(output, labels, temperature=temperature,
                                                            entropy=entropy)
                out, kwargs = aligned(per_position), {k: aligned(v) for k, v in kwargs.items()}
            if row is not None:
                out = unpack(out[0], row, width=seq_len)
                kwargs = {k: unpack(v[0], row, width=seq_len) for k, v in kwargs.items()}
            if len(index) == 0:  # a packed micro-batch of padding only, so every rank has as many
                return out.sum() * 0.0, {}
            if loss_fn is None:
                chunks.append((index, out.detach()))
                return out.sum() * 0.0, {}
            loss, stats = loss_fn(out, mb, **kwargs)
            for key, value in stats.items():
                stat_sums[key] = stat_sums.get(key, 0.0) + value.detach().float()
            if forward_only:
                chunks.append((index, out.detach()))
            return loss * loss_scale, {}

        def forward_step(data_iterator, model):
            index, row, (ids, labels, positions, packed), mb = next(data_iterator)
            output = model(ids, positions, None, packed_seq_params=packed)
            return output, partial(loss_func, index, row, labels, mb)

        for model in self.models:
            model.train(not forward_only)
        vpp = self.config.virtual_pipeline_model_parallel_size
        # Every chunk reads every micro-batch in order (positions and packing for all, tokens for the first,
        # the loss inputs for the last). The virtual stage count is passed, not read from parallel_state.
        get_forward_backward_func(pp_size=self.groups.pp_size, vp_size=vpp)(
            forward_step_func=forward_step, data_iterator=[iter(micro) for _ in self.models], model=self.models,
            num_microbatches=n_micro, seq_length=shape_len, micro_batch_size=shape_batch,
            forward_only=forward_only,
        )
        if not chunks:
            return None, stat_sums
        out = torch.zeros(batch, width, dtype=chunks[0][1].dtype, device=device)
        out[torch.cat([index for index, _ in chunks])] = torch.cat([values for _, values in chunks])
        return out[:, :seq_len], stat_sums

    def _packed_micro_batches(self, tokens: Tensor, extras: dict[str, Tensor], lengths: Tensor | None,
                              max_tokens: int) -> list:
        """Packed micro-batches of at most `max_tokens` tokens, as many on every data-parallel rank.

        The count is the largest first-fit-decreasing bin count over DP ranks (Megatron's DDP and pipeline
        schedules need one count everywhere), raised until the token-balanced split fits the budget on
        every rank. With pipeline stages every row is padded to the step's longest, so every message
        between stages has one shape. Each entry is (index [b], PackedRow, model inputs, micro-batch dict).
        """
        from megatron.core.packed_seq_params import PackedSeqParams

        if lengths is None:
            raise ValueError("packed micro-batches (micro_batch_tokens) need the sequence lengths")
        device = _device()
        lens = [int(n) for n in lengths]
        if max(lens) > tokens.shape[1]:
            raise ValueError(f"a length {max(lens)} exceeds the {tokens.shape[1]} columns of the batch")
        n_micro = self._schedulable(self._dp_reduce(count_bins(lens, max_tokens), dist.ReduceOp.MAX))
        while True:
            plan = plan_micro_batches(lens, max_tokens=max_tokens, n_micro=n_micro)
            # one more micro-batch helps; with one per sequence every plan fits, so this ends
            if self._dp_reduce(int(plan is None), dist.ReduceOp.MAX) == 0:
                break
            n_micro = self._schedulable(n_micro + 1)
        row_lens = [max(1, sum(lens[i] for i in part)) for part in plan]
        if self.groups.pp_size > 1:
            row_lens = [max(row_lens)] * len(plan)
        if self.config.sequence_parallel:
            # sequence parallelism splits the row evenly over TP ranks
            tp = self.groups.tp_size
            row_lens = [-(-n // tp) * tp for n in row_lens]
        micro = []
        for part, row_len in zip(plan, row_lens):
            row = packed_row(part, lengths, row_len=row_len)
            ids, positions = pack(tokens, row)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=row.cu_seqlens.to(device),
                                     cu_seqlens_kv=row.cu_seqlens.to(device), max_seqlen_q=row.max_seqlen,
                                     max_seqlen_kv=row.max_seqlen)
            mb = {"tokens": tokens[row.index].to(device), **{k: v[row.index].to(device) for k, v in extras.items()}}
            labels = F.pad(ids[:, 1:], (0, 1))  # the token after each position of the row
            micro.append((row.index, row, (ids.to(device), labels.to(device), positions.to(device), params), mb))
        return micro

    def _schedulable(self, n_micro: int) -> int:
        """The smallest micro-batch count from `n_micro` up that the pipeline schedule runs. Any count runs
        without virtual stages. The interleaved schedule runs micro-batches in groups of g =
        `microbatch_group_size_per_vp_stage` (default pp) through each chunk: at least g of them, and a last
        group of 0 or at least pp (a shorter one would leave stages waiting on each other)."""
        if self.config.virtual_pipeline_model_parallel_size is None:
            return n_micro
        group, pp = self.config.microbatch_group_size_per_vp_stage, self.groups.pp_size
        n_micro = max(n_micro, group)
        while 0 < n_micro % group < pp:
            n_micro += 1
        return n_micro

    def _dp_reduce(self, value: int, op) -> int:
        if self.groups.dp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_device())
        dist.all_reduce(t, op=op, group=self.groups.dp)
        return int(t)

    def _token_logprobs(self, logits: Tensor, labels: Tensor, *, temperature: float, entropy: bool
                        ) -> tuple[Tensor, dict[str, Tensor]]:
        """logits [b, s, V/tp] and labels [b, s] (the token after each position) -> (logprobs of the labels
        [b, s], {"entropy": [b, s]} of the next-token distribution when asked), position by position."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        scaled = self._mask_vocab_padding(logits.float() / temperature)
        if not entropy:
            return -vocab_parallel_cross_entropy(scaled, labels), {}
        token_entropy = self._vocab_parallel_entropy(scaled)
        # Megatron's cross entropy works in place on its input: give it a copy of the logits entropy used
        logprobs = -vocab_parallel_cross_entropy(scaled.clone(), labels)
        return logprobs, {"entropy": token_entropy}

    def _mask_vocab_padding(self, logits: Tensor) -> Tensor:
        """Rows added to make the vocabulary split evenly over TP hold zero weights, so their logit is 0,
        not -inf: they would take probability mass the HF model does not have. Give them the lowest
        finite logit instead (finite, so 0 * logit stays 0 in the entropy)."""
        vocab_slice = logits.shape[-1]
        first = self.groups.tp_rank * vocab_slice
        real = max(0, min(vocab_slice, self.shape.vocab_size - first))
        if real == vocab_slice:
            return logits
        padding = torch.arange(vocab_slice, device=logits.device) >= real
        return logits.masked_fill(padding, torch.finfo(logits.dtype).min)

    def _vocab_parallel_entropy(self, logits: Tensor) -> Tensor:
        """Entropy [b, T] of softmax over the full vocabulary from this rank's slice logits [b, T, V/tp].

        H = log S + m - (1/S) sum_v exp(z_v - m) z_v with S = sum_v exp(z_v - m) over all slices. The sums
        are all-reduced forward with an identity backward (every TP rank computes the same loss, so each
        receives the full gradient of its own slice).
        """
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        m = logits.detach().max(dim=-1, keepdim=True).values
        if self.groups.tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.groups.tp)
        e = torch.exp(logits - m)
        sums = torch.stack([e.sum(-1), (e * logits).sum(-1)])
        if self.groups.tp_size > 1:
            sums = reduce_from_tensor_model_parallel_region(sums, group=self.groups.tp)
        return torch.log(sums[0]) + m.squeeze(-1) - sums[1] / sums[0]

    @torch.no_grad()
    def logprobs(self, tokens: Tensor, *, temperature: float, micro_batch_size: int,
                 lengths: Tensor | None = None, micro_batch_tokens: int | None = None) -> Tensor:
        """Token logprobs [B, T] of `tokens` [B, T] on every rank of the pipeline (micro-batching as in
        `_run`: `micro_batch_tokens` packs sequences of `lengths` [B] tokens)."""
        if self.value_head:
            raise ValueError("a critic has no token logprobs; use values()")
        out, _ = self._run(tokens, {}, None, temperature=temperature, micro_batch_size=micro_batch_size,
                           forward_only=True, lengths=lengths, micro_batch_tokens=micro_batch_tokens)
        return self._from_last_stage(out, tokens.shape).cpu()

    @torch.no_grad()
    def values(self, tokens: Tensor, *, micro_batch_size: int, lengths: Tensor | None = None,
               micro_batch_tokens: int | None = None) -> Tensor:
        """A critic's values [B, T]: column t is V(tokens[:t]), the state in which token t was chosen."""
        if not self.value_head:
            raise ValueError("values() needs a critic (TrainEngine(value_head=True))")
        out, _ = self._run(tokens, {}, None, temperature=1.0, micro_batch_size=micro_batch_size,
                           forward_only=True, lengths=lengths, micro_batch_tokens=micro_batch_tokens)
        return self._from_last_stage(out, tokens.shape).cpu()

    def train_step(self, tokens: Tensor, extras: dict[str, Tensor], loss_fn: LossFn, *, temperature: float,
                   micro_batch_size: int, entropy: bool = False, lengths: Tensor | None = None,
                   micro_batch_tokens: int | None = None) -> dict[str, float]:
        """One optimizer step on this rank's share [B, T] of the global batch.

        `loss_fn(outputs [b, T], micro-batch dict)` sees logprobs (values for a critic), plus
        `entropy=` [b, T] when `entropy` is True; `micro_batch_tokens` packs sequences of `lengths` [B]
        tokens into micro-batches (`_run`). Returns its statistics summed over micro-batches and DP
        ranks (each one a contribution normalized by global counts, so the sums are global means), plus
        `grad_norm`.
        """
        _, stats = self._run(tokens, extras, loss_fn, temperature=temperature,
                             micro_batch_size=micro_batch_size, forward_only=False, entropy=entropy,
                             lengths=lengths, micro_batch_tokens=micro_batch_tokens)
        ok, grad_norm, _ = self.optimizer.step()
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.step += 1
        metrics = self._reduce_stats(stats)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        if not ok:
            metrics["skipped_step"] = 1.0
        return metrics

    def _from_last_stage(self, tensor: Tensor | None, shape) -> Tensor:
        if self.groups.pp_size == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=torch.float32, device=_device())
        dist.broadcast(tensor, src=self.groups.pp_last_global_rank, group=self.groups.pp)
        return tensor

    def _reduce_stats(self, stats: dict[str, Tensor]) -> dict[str, float]:
        """Sum statistics over DP ranks and send them from the last pipeline stage to every rank."""
        keys = [sorted(stats)] if self.groups.is_pp_last else [None]
        if self.groups.pp_size > 1:
            dist.broadcast_object_list(keys, src=self.groups.pp_last_global_rank, group=self.groups.pp)
        values = torch.stack([torch.as_tensor(stats.get(k, 0.0), dtype=torch.float64) for k in keys[0]]) \
            if keys[0] else torch.zeros(0, dtype=torch.float64)
        values = values.to(_device())
        if self.groups.pp_size > 1:
            dist.broadcast(values, src=self.groups.pp_last_global_rank, group=self.groups.pp)
        if self.groups.dp_size > 1:
            dist.all_reduce(values, group=self.groups.dp)
        return {k: float(v) for k, v in zip(keys[0], values.tolist())}


def meta_engine(model_dir: str | Path, *, dtype: str, tp: int = 1, pp: int = 1, ep: int = 1) -> TrainEngine:
    """A frozen TrainEngine whose model lives on the meta device: Megatron's names, shapes and sharding at
    this layout, no weights, for the conversion tools to stream tensors through (`save_checkpoint(hf_dir=)`,
    `hf_tensors(checkpoint=)`). ValueError, naming the numbers, when the layout does not split the model
    or the torchrun world."""
    import warnings

    shape = read_shape(model_dir)
    check_layout(shape, tp=tp, pp=pp, cp=1, ep=ep, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    # Without GPU-only Apex / Transformer Engine megatron warns at import about its fallbacks, which are the
    # intended code on CPU; a conversion's output is its progress.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    groups = init_parallel(tp=tp, pp=pp, ep=ep)
    with torch.device("meta"):
        return TrainEngine(model_dir=str(model_dir), dtype=dtype, megatron={}, groups=groups, load_weights=False)


def _check_checkpoint(path: Path, model_state: dict) -> None:
    """Before reading distributed checkpoint `path` into a model whose sharded state is `model_state`: a
    CheckpointError naming the missing or truncated file, or listing the tensors that do not match."""
    from megatron.core.dist_checkpointing import ShardedTensor, load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: not a distributed checkpoint (no metadata.json)")
    _check_files(path)
    saved = load_tensors_metadata(str(path))
    problems = []
    for sharded in nested_values(model_state):
        if not isinstance(sharded, ShardedTensor):
            continue
        if sharded.key not in saved:
            problems.append(f"{sharded.key}: not in the checkpoint")
        elif tuple(saved[sharded.key].global_shape) != tuple(sharded.global_shape):
            problems.append(f"{sharded.key}: shape {tuple(saved[sharded.key].global_shape)} in the "
                            f"checkpoint, {tuple(sharded.global_shape)} in this model")
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        shown = "\n  ".join(problems[:20]) + more
        raise CheckpointError(f"{path}: {len(problems)} tensor(s) do not match this model "
                              f"(another architecture or size?):\n  {shown}")


def _check_files(path: Path) -> None:
    """Every data file the checkpoint's index lists is there and long enough: a copy cut short (a full
    disk, an interrupted transfer) is an error naming the file, not an unpickling error deep inside."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable index is the same problem for the user
        raise CheckpointError(f"{path}: the checkpoint index (.metadata) cannot be read: {e}") from None
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the checkpoint index but missing")
        if file.stat().st_size < end:
            raise CheckpointError(f"{file}: truncated ({file.stat().st_size} bytes; the index needs {end})")


def trainer_rng_state() -> dict:
    """This rank's random state: torch's (CPU and, on GPU, CUDA) and Megatron's model-parallel RNG tracker
    (dropout streams). Restored by `set_trainer_rng_state` on a resume with the same layout."""
    from megatron.core import tensor_parallel

    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_trainer_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _pad_rows(full: Tensor, rows: int) -> Tensor:
    """Zero rows appended to a vocabulary matrix up to Megatron's padded size."""
    if full.shape[0] == rows:
        return full
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
