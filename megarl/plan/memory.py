"""The memory model of `megarl plan`: what each phase of a step holds on one GPU, and on the host of a node.

The estimate follows the code it models, so its assumptions are those of megarl's engines:
- Parameters: exactly the tensors Megatron's GPTModel creates on the most-loaded GPU of a pipeline stage
  (vocabulary padded as `padded_vocab_size` pads it, embedding on the first stage, output layer on the last
  unless tied and pp = 1, norms replicated over TP, routed experts split over ep and each over etp, shared
  experts over tp). Stored in `model.dtype`.
- Gradients: fp32 (the engine sets `grad_reduce_in_fp32`), 4 bytes per trainable parameter.
- Optimizer: Adam's two fp32 moments (8 bytes) plus an fp32 master copy (4 bytes) when parameters are not fp32,
  sharded over dp*cp ranks (over the expert data-parallel ranks for experts) with `optim.distributed`.
  DDP's bucket padding (at most 63 elements per parameter, 127 per bucket) is not counted.
- Optimizer offload (`optim.cpu_offload` f, megarl.engine.megatron): Megatron's HybridDeviceOptimizer keeps the
  moments and master copy of a share f of the rank's optimizer elements in host memory, in every phase, with a
  host copy of their fp32 gradients (4 bytes more per element), and steps them there; the device holds the rest.
  It offloads whole tensors in order until the share reaches f, so the device holds at most 1 - f of the state
  and the host at least f (at most one tensor more than counted).
- LoRA (`model.lora`): the actor's frozen base in `model.dtype` plus its adapters (`lora_params`: A and B of
  every targeted linear, split over TP as megarl.engine.lora_layers splits them), gradients and Adam state
  (moments, fp32 master copy) for the adapters only, and no reference model (the actor with its adapters off
  is the reference). The adapters' rank-r activations are not counted (r / hidden of a layer's).
- Activations: Korthikanti et al. 2022 (arXiv:2205.05198), Table 2, generalized to grouped-query attention,
  SwiGLU and routed experts, for 16-bit activations: per token and layer 10*h bytes replicated over TP (all
  divided by tp with `sequence_parallel`) plus 4*heads*d + 4*kv_heads*d + 6*ffn bytes split over TP; a routed
  MLP keeps top-k copies of the token (4*h*k) and 6*moe_ffn*k bytes over TP, with balanced routing. No
  seq^2 attention term: Transformer Engine's fused attention (the GPU image) or selective recomputation keeps
  none. Full recomputation keeps each recomputed unit's 2*h-byte input plus one unit in flight
  (`recompute_method` uniform: units of `recompute_num_layers` layers; block: that many layers recomputed one
  by one). The first pipeline stage holds min(micro-batches, pp) micro-batches in flight (1F1B), times
  1 + (pp-1)/(pp*vpp) with virtual stages; the last stage holds one, plus the logprob head: 16 bytes per token
  and vocabulary entry of its TP slice (bf16 logits, fp32 copies for temperature and vocabulary padding, one
  kept by the cross entropy for backward), 8 more with an entropy bonus. Sequences are right padded to
  the longest the recipe allows (`sequence_tokens`): prompt + rollout.max_new_tokens for one turn; prompt +
  env.max_tokens for a multi-turn environment (generated and observation tokens of all turns); for SFT and
  DPO, whose loops pad a batch to its longest row and truncate nothing, the longest row (`--seq-tokens`).
  The prompt length is an input, `--prompt-tokens`.
- Models, as the loops build them: RL: the actor, the frozen reference when algo.kl_coef > 0, the frozen
  distillation teacher (its own shape, offloaded like the reference) when teacher.path is set, PPO's critic,
  and the frozen reward model of every `reward_model` reward term, which stays on the device in every phase;
  SFT: the actor; DPO: the actor and its frozen reference (no gradients, no optimizer).
- Phases, as `megarl.loops.rl` orders them on GPU: train = every trainer model's parameters, gradients and
  optimizer state on the device with the larger of the actor's and the critic's activations; push = trainer
  parameters (gradients and optimizer state already offloaded) + SGLang's weights + one handoff bucket + two
  copies of the largest full tensor (TP shards and their concatenation); rollout = SGLang's static pool with
  the trainer offloaded. SFT and DPO have no rollout engine: the train phase only. Either engine gives back its
  weights and KV cache before train, except the base weights of an engine that takes adapters alone
  (rollout.lora_sync: adapter), which stay; the native engine's KV cache holds the rank's samples.
- Placement split (megarl.loops.split): nothing is offloaded and no GPU holds both kinds of state. A training
  GPU: train as above, and push = every trainer model's state + one bucket + two copies of the largest full
  tensor (training rank 0 broadcasts the buckets). A rollout GPU: rollout = the engine's static memory, push =
  that + the one bucket it receives. The reward models live on the training GPUs.
- SGLang's pool, as SGLang 0.5.23 sizes it (kv_cache_configurator): the engines start before the trainer
  builds its models (with placement split, on GPUs the trainer never uses), so the memory free when a
  scheduler measures it is the GPU less the CUDA contexts and the engine's communicators
  (ENGINE_START_USED_GIB); the KV cache gets `rollout.mem_fraction` of that, less the engine's weights (its
  GPU's share of the model: full / rollout.tp).
- Host memory (megarl.engine.offload, during every rollout of an RL step): each trainer model's parameters
  in pinned buffers, the actor's and critic's optimizer state (Adam moments, fp32 master copy) moved to host
  memory by Megatron; gradient buffers are freed, not copied. The share optim.cpu_offload keeps on the host is
  there in every phase, also in SFT, DPO and on placement split's training GPUs, which offload nothing else. With the distributed optimizer Megatron makes
  the pinned copy of a parameter buffer through a pageable one on the first offload, so one buffer's worth
  more is held briefly. Plus HOST_RESERVE_GIB per GPU for the processes (trainer, SGLang scheduler,
  tokenizer). Summed over the GPUs of the fullest node (pipeline stages are Megatron's outermost rank
  axis), against HOST_USABLE_FRACTION of `--host-mem-gb`. Placement split offloads nothing: the reserve of
  every GPU and the routes of the training GPUs.
- MoE routes (megarl.routing), for every RL recipe of a MoE model, whatever algo.router_replay says (the
  metric moe/routing_agreement needs them on every MoE run): the rollout engines record each token's top-k
  expert ids at every MoE layer, `route_bytes_per_token` bytes per token. They travel in the rollout batch on
  the host from generation to the end of training, so every GPU's process holds its data-parallel rank's share
  of the step (data.prompts_per_step x rollout.n_samples / dp samples of `sequence_tokens`, padding counted):
  per node that adds to the offloaded trainer state (placement split: the training GPUs' processes hold them).
  While training, the replaying trainer holds one micro-batch's routes on the device as int64 indices
  ([tokens, top_k] per MoE layer of the stage), counted in the train phase whether or not replay is on.
- Not modelled: CUDA contexts, NCCL buffers and SGLang's CUDA graphs (a fixed RESERVE_GIB per GPU instead),
  allocator fragmentation (only USABLE_FRACTION of the GPU counts as usable), expert load imbalance.

Imports only the standard library and megarl's config, layout, model-shape and route-size readers (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config import Config, LoraConfig
from megarl.layout import Layout
from megarl.models.arch import ModelShape, padded_vocab_size
from megarl.routing import route_bytes_per_token

GIB = 2**30
RESERVE_GIB = 4.0  # CUDA contexts of trainer and SGLang scheduler (~0.5 each), NCCL communicators (1-3)
USABLE_FRACTION = 0.95  # the rest is left to allocator fragmentation
ENGINE_START_USED_GIB = 1.5  # in use when SGLang measures free memory: both CUDA contexts, its communicators
HOST_RESERVE_GIB = 8.0  # host memory per GPU of the trainer process and SGLang's scheduler and tokenizer
HOST_USABLE_FRACTION = 0.9  # the rest is left to the OS and the file cache
DEFAULT_HOST_MEM_GIB = 2048.0  # a DGX H100/H200 node: 2 TiB
LOGITS_BYTES = 16  # per token and vocabulary entry of the TP slice, for the logprob head (see module doc)
ENTROPY_BYTES = 8  # two more fp32 tensors of that size when algo.entropy_coef > 0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4  # fp32 gradient buffers
ADAM_BYTES = 8  # two fp32 moments
MASTER_BYTES = 4  # fp32 master parameters when the model is 16-bit
OFFLOAD_GRAD_BYTES = 4  # optim.cpu_offload: the host copy of an offloaded element's fp32 gradient
REPLAY_INDEX_BYTES = 8  # the trainer's replayed expert ids are int64 indices on the device


@dataclass(frozen=True)
class ParamCounts:
    """Parameters on one GPU: `dense` are sharded by the distributed optimizer over dp*cp, `expert` over
    the expert data-parallel ranks."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_params(shape: ModelShape, *, tp: int, pp: int, ep: int, stage: int, etp: int | None = None,
                 value_head: bool = False, padded_vocab: int | None = None) -> ParamCounts:
    """Parameters one GPU of pipeline stage `stage` holds, tensor by tensor as GPTModel builds them
    (local or Transformer Engine spec: TE fuses the norms into the linears without changing the count).

    `etp` splits each routed expert's linears (None: tp, Megatron's default).
    `value_head` is megarl's critic: untied, a [1, h] head in place of the output layer.
    `padded_vocab` defaults to Megatron's padding for `tp`."""
    etp = tp if etp is None else etp
    h = shape.hidden
    vocab = padded_vocab if padded_vocab is not None else padded_vocab_size(shape.vocab_size, tp=tp)
    norms = 2 * h + (2 * h if shape.post_norms else 0)  # input and pre-MLP norms (+ Gemma 3's output norms)
    common = _attention_params(shape, tp=tp) + norms
    # a MoE layer: router (replicated over TP, with its bias or expert bias), shared expert, this rank's experts
    moe_dense = shape.experts * h + (shape.experts if shape.linear_bias or shape.expert_bias else 0)
    if shape.shared_ffn:
        moe_dense += 3 * h * shape.shared_ffn // tp + (h if shape.shared_gate else 0)
    # fc1 [gate; up] and fc2 split over etp; gpt-oss's biases: fc1's split, fc2's whole
    per_expert = 3 * h * shape.moe_ffn // etp + ((2 * shape.moe_ffn // etp + h) if shape.linear_bias else 0)
    dense = expert = 0
    for layer in range(stage * shape.layers // pp, (stage + 1) * shape.layers // pp):
        if shape.is_moe_layer(layer):
            dense, expert = dense + common + moe_dense, expert + shape.experts // ep * per_expert
        else:
            dense += common + 3 * h * shape.ffn // tp  # gate and up fused, then down
    first, last = stage == 0, stage == pp - 1
    tied = shape.tied_embeddings and not value_head
    if first:
        dense += vocab * h // tp
    if last:
        dense += h  # final norm
        if value_head:
            dense += h
        elif not (tied and pp == 1):  # with pp > 1 the last stage holds its own copy of tied embeddings
            dense += vocab * h // tp
    return ParamCounts(dense=dense, expert=expert)


def _attention_params(shape: ModelShape, *, tp: int) -> int:
    """One layer's attention parameters on one TP rank. Multi-latent attention (DeepSeek-V3): the down-projections
    and the latents' norms whole on every rank, the up-projections and the output split over TP."""
    h, d, heads = shape.hidden, shape.head_dim, shape.heads
    if shape.mla:
        q_lora = shape.q_lora_rank
        query = h * q_lora + q_lora + q_lora * heads * d // tp if q_lora else h * heads * d // tp
        kv = (h * (shape.kv_lora_rank + shape.qk_rope_dim) + shape.kv_lora_rank
              + shape.kv_lora_rank * heads * (shape.qk_nope_dim + shape.v_head_dim) // tp)
        return query + kv + heads * shape.v_head_dim * h // tp
    params = h * (heads + 2 * shape.kv_heads) * d // tp + heads * d * h // tp
    if shape.qkv_bias:
        params += (heads + 2 * shape.kv_heads) * d // tp
    if shape.linear_bias:  # gpt-oss: the output projection's bias, replicated, and one sink per head
        params += h
    if shape.attention_sinks:
        params += heads // tp
    return params + (2 * d if shape.qk_norm else 0)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float = 80.0
    host_mem_gib: float = DEFAULT_HOST_MEM_GIB  # per node

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ModelMemory:
    """Bytes one trainer model holds on one GPU of the planned stage."""

    name: str  # actor, reference, teacher, critic or a reward model
    params: int
    grads: int
    optim: int  # on the device
    activations: int  # peak of one training pass (0 for a frozen model)
    # optimizer state on the host in every phase (optim.cpu_offload): its share of the moments and master copy,
    # and the host copy of their gradients
    host_optim: int = 0

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optim


def lora_params(shape: ModelShape, lora: LoraConfig, *, tp: int, pp: int, ep: int = 1) -> int:
    """Adapter parameters one GPU of a pipeline stage holds: per layer and target, A [r, in] and B [out, r], the
    factor on the split side of the wrapped linear divided by tp (column-parallel: B; row-parallel: A). A MoE
    model's fc1 and fc2 are those of this rank's experts (experts / ep, unsplit: adapters on experts need
    parallel.etp 1) and of its shared expert (split over tp)."""
    h, r = shape.hidden, lora.rank
    qkv_out, attn_in = (shape.heads + 2 * shape.kv_heads) * shape.head_dim, shape.heads * shape.head_dim

    def fc1(ffn: int, split: int) -> int:
        return r * h + 2 * ffn * r // split

    def fc2(ffn: int, split: int) -> int:
        return r * ffn // split + h * r

    per_target = {"qkv": r * h + qkv_out * r // tp, "proj": r * attn_in // tp + h * r,
                  "fc1": fc1(shape.ffn, tp), "fc2": fc2(shape.ffn, tp)}
    if shape.is_moe:
        shared = bool(shape.shared_ffn)
        per_target["fc1"] = shape.experts // ep * fc1(shape.moe_ffn, 1) + shared * fc1(shape.shared_ffn, tp)
        per_target["fc2"] = shape.experts // ep * fc2(shape.moe_ffn, 1) + shared * fc2(shape.shared_ffn, tp)
    return shape.layers // pp * sum(per_target[t] for t in lora.targets)


def model_state(counts: ParamCounts, *, dtype: str, trainable: bool, distributed: bool, dp: int,
                expert_dp: int, adapters: int = 0, cpu_offload: float = 0.0) -> tuple[int, int, int, int]:
    """(parameter, gradient, device optimizer, host optimizer) bytes of `counts` parameters on one GPU (see
    module doc); with `adapters` > 0 (LoRA) those are the ones that train, beside the frozen `counts`;
    `cpu_offload`: the share of the optimizer's elements Megatron keeps and steps on the host."""
    params = (counts.total + adapters) * DTYPE_BYTES[dtype]
    if not trainable:
        return params, 0, 0, 0
    per_param = ADAM_BYTES + (MASTER_BYTES if dtype != "float32" else 0)
    if adapters:  # dense parameters, sharded over dp * cp like the rest
        trained, elements = adapters, (-(-adapters // dp) if distributed else adapters)
    elif distributed:
        trained, elements = counts.total, -(-counts.dense // dp) + -(-counts.expert // expert_dp)
    else:
        trained, elements = counts.total, counts.total
    on_host = int(cpu_offload * elements)
    return (params, GRAD_BYTES * trained, per_param * (elements - on_host),
            (per_param + OFFLOAD_GRAD_BYTES) * on_host)


def layer_activation_bytes(shape: ModelShape, *, tp: int, sequence_parallel: bool,
                           act_bytes: int) -> float:
    """Bytes one transformer layer keeps for backward per token (Korthikanti et al., generalized; module doc)."""
    h, d = shape.hidden, shape.head_dim
    replicated = 10 * h
    split = 4 * shape.heads * d + 4 * shape.kv_heads * d
    if shape.experts:
        replicated += 4 * h * shape.topk + 4 * shape.experts  # routed token copies, fp32 router scores
        split += 6 * shape.moe_ffn * shape.topk + 6 * shape.shared_ffn
    else:
        split += 6 * shape.ffn
    per_token = (replicated / tp if sequence_parallel else replicated) + split / tp
    return per_token * act_bytes / 2


def activation_bytes(shape: ModelShape, layout: Layout, *, stage: int, seq_len: int, micro_batch_size: int,
                     megatron: dict, act_bytes: int, head_bytes_per_token: float) -> int:
    """Peak activation bytes of one training pass on one GPU of pipeline stage `stage`, on sequences of
    `seq_len` tokens."""
    tokens = micro_batch_size * seq_len / layout.cp
    per_layer = tokens * layer_activation_bytes(shape, tp=layout.tp, act_bytes=act_bytes,
                                                sequence_parallel=bool(megatron.get("sequence_parallel")))
    layer_input = tokens * shape.hidden * act_bytes
    layers = shape.layers // layout.pp
    recompute = megatron.get("recompute_granularity")
    unit = megatron.get("recompute_num_layers") or 1
    if recompute == "full" and megatron.get("recompute_method") == "block":
        done = min(unit, layers)
        kept, transient = done * layer_input + (layers - done) * per_layer, per_layer
    elif recompute == "full":  # uniform
        kept, transient = math.ceil(layers / unit) * layer_input, min(unit, layers) * per_layer
    else:  # none or selective: every layer's activations, without a seq^2 term
        kept, transient = layers * per_layer, 0.0
    if layout.pp == 1:
        in_flight = 1.0
    elif layout.vpp > 1:
        in_flight = layout.pp * (1 + (layout.pp - 1) / (layout.pp * layout.vpp))
    else:
        in_flight = min(layout.micro_batches, layout.pp) if stage == 0 else 1
    head = tokens * head_bytes_per_token if stage == layout.pp - 1 else 0.0
    return int(kept * in_flight + transient + head)


@dataclass(frozen=True)
class Rollout:
    """One rollout engine's share of one GPU."""

    engine: str
    gpus: int  # GPUs per engine
    engines: int
    weights: int  # bytes of model weights on each engine GPU
    static: int  # bytes SGLang reserves (weights + KV cache); the native engine's weights + KV
    kv_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int  # tokens the KV cache holds
    samples: int  # full-length samples the KV cache holds at once


def kv_bytes_per_token(shape: ModelShape, *, dtype: str, tp: int = 1) -> int:
    """Bytes of one token's keys and values on one GPU of a rollout engine of `tp` GPUs (the native engine: 1).
    Multi-latent attention caches the compressed latent and the shared RoPE key per layer instead (SGLang's MLA
    pool), whole on every TP rank."""
    if shape.mla:
        return shape.layers * (shape.kv_lora_rank + shape.qk_rope_dim) * DTYPE_BYTES[dtype]
    kv_heads = max(1, shape.kv_heads // tp)  # replicated when tp exceeds the KV heads
    return 2 * shape.layers * kv_heads * shape.head_dim * DTYPE_BYTES[dtype]


def sglang_pool_bytes(*, free_bytes: float, mem_fraction: float, weight_bytes: int) -> int:
    """The bytes SGLang's KV cache gets (kv_cache_configurator, profiling path): `mem_fraction` of the memory
    free when its scheduler starts (`free_bytes`: device memory on GPU, host memory in CPU mode), less the
    engine's own weights, which are loaded inside that budget; 0 when the weights take it all."""
    return max(0, int(mem_fraction * free_bytes) - weight_bytes)


def sglang_pool_tokens(shape: ModelShape, *, free_bytes: float, mem_fraction: float, weight_bytes: int,
                       dtype: str, tp: int = 1) -> int:
    """Tokens SGLang's KV pool holds when it starts with `free_bytes` free (see sglang_pool_bytes)."""
    pool = sglang_pool_bytes(free_bytes=free_bytes, mem_fraction=mem_fraction, weight_bytes=weight_bytes)
    return pool // kv_bytes_per_token(shape, dtype=dtype, tp=tp)


def rollout_memory(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster, *, seq_len: int) -> Rollout:
    """One engine's memory on each of its GPUs, for samples of `seq_len` tokens."""
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    full = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size).total
    if cfg.rollout.engine == "sglang":
        rtp = cfg.rollout.tp
        per_token = kv_bytes_per_token(shape, dtype=cfg.model.dtype, tp=rtp)
        weights = full * dtype_bytes // rtp
        # SGLang takes mem_fraction of the memory free when its scheduler starts, before the trainer's
        # models exist (megarl.loops.rl_run.build_run) or on a rollout rank's GPU, which holds no trainer
        # (placement split): the GPU less the engines' contexts.
        free = (cluster.gpu_mem_gib - ENGINE_START_USED_GIB) * GIB
        pool = dict(free_bytes=free, mem_fraction=cfg.rollout.mem_fraction, weight_bytes=weights)
        kv = sglang_pool_bytes(**pool)
        static = int(cfg.rollout.mem_fraction * free)  # the weights and the KV cache
        tokens = sglang_pool_tokens(shape, **pool, dtype=cfg.model.dtype, tp=rtp)
    else:  # native: a whole transformers model on the first rank of every group of rollout.tp ranks
        rtp = 1
        per_token = kv_bytes_per_token(shape, dtype=cfg.model.dtype)
        weights = full * dtype_bytes
        engines = len(layout.engine_ranks)
        samples = -(-cfg.data.prompts_per_step * cfg.rollout.n_samples // engines)  # the step's samples, split
        kv = samples * seq_len * per_token
        static = weights + kv
        tokens = kv // per_token
    return Rollout(engine=cfg.rollout.engine, gpus=rtp, engines=len(layout.engine_ranks), weights=weights,
                   static=static, kv_bytes=kv, kv_bytes_per_token=per_token, kv_tokens=tokens,
                   samples=tokens // seq_len)


@dataclass(frozen=True)
class Routing:
    """The MoE routes of one RL step (megarl.routing; module doc)."""

    bytes_per_token: int  # host bytes of one token's routes: MoE layers x top-k expert ids
    tokens_per_rank: int  # tokens of the samples one data-parallel rank holds (padded to `sequence_tokens`)
    host_per_rank: int  # bytes per GPU: its rank's routes, in the rollout batch on the host
    host_per_node: int  # bytes per node: every training GPU's process holds its rank's routes
    device_train: int  # bytes per GPU in the train phase: one micro-batch's routes as int64 indices


def routing_memory(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster, *,
                   seq_len: int) -> Routing | None:
    """The step's MoE routes per GPU and per node, samples padded to `seq_len` tokens; None for a dense model or
    an offline recipe (no rollout)."""
    if not shape.is_moe or cfg.algo.traits.offline:
        return None
    per_token = route_bytes_per_token(moe_layers=shape.moe_layers, top_k=shape.topk, experts=shape.experts)
    tokens = cfg.data.prompts_per_step * cfg.rollout.n_samples // layout.dp * seq_len
    # One micro-batch as the trainer runs it (its CP slice), every MoE layer of the stage, int64 ids.
    micro_tokens = cfg.train.micro_batch_size * seq_len // layout.cp
    device = micro_tokens * shape.topk * -(-shape.moe_layers // layout.pp) * REPLAY_INDEX_BYTES
    # Ranks fill the nodes in order, so the first node holds the most training ranks.
    trainers = min(cluster.gpus_per_node, layout.world)
    return Routing(bytes_per_token=per_token, tokens_per_rank=tokens, host_per_rank=tokens * per_token,
                   host_per_node=trainers * tokens * per_token, device_train=device)


@dataclass(frozen=True)
class HostMemory:
    """Host memory of the trainer state offloaded while the rollout engines generate (megarl.engine.offload;
    none with placement split). Per-GPU numbers are those of the pipeline stage that holds the most."""

    params: int  # bytes per GPU: every trainer model's parameters, in pinned buffers
    optim: int  # bytes per GPU: the trained models' optimizer state (moments, fp32 master copy), `kept` included
    kept: int  # bytes per GPU of it on the host in every phase (optim.cpu_offload), its gradient copies included
    first_offload: int  # bytes per GPU: the pageable copy of one parameter buffer Megatron pins through, once
    routes: int  # bytes per GPU: the step's MoE routes of its data-parallel rank (0 for a dense model)
    per_node: int  # bytes on the fullest node, HOST_RESERVE_GIB per GPU included
    limit: int  # usable bytes per node


def host_memory(cfg: Config, cluster: Cluster, layout: Layout, stages: list[list[ModelMemory]],
                buffers: list[int], routes: int = 0) -> HostMemory:
    """What the RL loop moves to the host, per GPU of each pipeline stage (`stages[s]`: its models; `buffers[s]`:
    the bytes of its largest DDP parameter buffer), with the `routes` bytes every training GPU's process holds
    while the trainer is offloaded, and the optimizer state optim.cpu_offload keeps there in every phase, summed
    over the GPUs of the fullest node. SFT and DPO move nothing, and neither does placement split, whose rollout
    GPUs hold only the processes' reserve."""
    limit = int(HOST_USABLE_FRACTION * cluster.host_mem_gib * GIB)
    reserve = int(HOST_RESERVE_GIB * GIB)
    kept = [sum(m.host_optim for m in models) for models in stages]
    if cfg.algo.traits.offline or layout.rollout_ranks:  # the trainer's state never leaves its GPUs
        per_gpu = [(0, kept[s], 0, routes) for s in range(len(stages))]
    else:
        per_gpu = [(sum(m.params for m in models), sum(m.optim for m in models) + kept[s],
                    buffers[s] if cfg.optim.distributed else 0, routes) for s, models in enumerate(stages)]
    # Megatron's rank order puts pipeline stages outermost: ranks [s * world/pp, (s+1) * world/pp) are stage s.
    per_stage = layout.world // layout.pp
    nodes = [sum((sum(per_gpu[rank // per_stage]) if rank < layout.world else 0) + reserve
                 for rank in range(n * cluster.gpus_per_node, (n + 1) * cluster.gpus_per_node))
             for n in range(cluster.nodes)]
    fullest = max(range(len(per_gpu)), key=lambda s: sum(per_gpu[s]))
    params, optim, first, routes = per_gpu[fullest]
    return HostMemory(params=params, optim=optim, kept=kept[fullest], first_offload=first, routes=routes,
                      per_node=max(nodes), limit=limit)



def largest_tensor(shape: ModelShape) -> int:
    """Elements of the largest full HF tensor the weight push gathers (fused QKV and gate/up included)."""
    h, d = shape.hidden, shape.head_dim
    mlp = 2 * (shape.moe_ffn if shape.experts else shape.ffn) * h
    return max(shape.vocab_size * h, h * (shape.heads + 2 * shape.kv_heads) * d, mlp, 2 * shape.shared_ffn * h)

