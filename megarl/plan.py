"""`megarl plan`: check a recipe against a cluster and estimate the memory of every GPU, without a GPU.

    megarl plan RECIPE.yaml --nodes 8 --gpus-per-node 8 [--gpu-mem-gb 80] [--host-mem-gb 2048]
        [--model-config config.json] [--json] [key.path=value ...]

Planning reads the recipe (its files need not exist on this machine) and the model's HF `config.json` (from
`model.path`, or `--model-config` where the checkpoint lives only on the cluster), then:

1. checks that the layout divides: world size by tp*pp*cp, heads, query groups, MLP width by tp, layers by pp
   (and by pp * virtual stages), experts by ep and the expert grid tp*ep*pp by the world, the global batch
   by the data-parallel size and micro-batch, and that every rollout engine fits inside one node without
   sharing a GPU with another engine. A failure raises PlanError naming both numbers (exit code 2).
   With `placement.mode: split` the trainer's world is the job's less the last `placement.rollout_ranks`
   ranks, which only generate (megarl.loops.split): tp, pp, cp, ep and dp divide that world.
2. estimates, per GPU, the bytes each phase of an RL step holds on the device (train, weight push, rollout;
   SFT and DPO only train), and per node the host memory the offloaded trainer state takes, and says
   whether everything fits (exit code 0) or not (exit code 1, with the reasons). A split plan estimates the
   training GPUs and the rollout GPUs apart, and both must fit.

The estimate follows the code it models, so its assumptions are those of megarl's engines:
- Parameters: exactly the tensors Megatron's GPTModel creates on the most-loaded GPU of a pipeline stage
  (vocabulary padded as `padded_vocab_size` pads it, embedding on the first stage, output layer on the last
  unless tied and pp = 1, norms replicated over TP, experts split over ep and over tp as Megatron's default
  expert-tensor-parallel size equals tp). Stored in `model.dtype`.
- Gradients: fp32 (the engine sets `grad_reduce_in_fp32`), 4 bytes per trainable parameter.
- Optimizer: Adam's two fp32 moments (8 bytes) plus an fp32 master copy (4 bytes) when parameters are not fp32,
  sharded over dp*cp ranks (over the expert data-parallel ranks for experts) with `optim.distributed`.
  DDP's bucket padding (at most 63 elements per parameter, 127 per bucket) is not counted.
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
- Models, as the loops build them: RL: the actor, the frozen reference when algo.kl_coef > 0, PPO's critic,
  and the frozen reward model of every `reward_model` reward term, which stays on the device in every phase;
  SFT: the actor; DPO: the actor and its frozen reference (no gradients, no optimizer).
- Phases, as `megarl.loops.rl` orders them on GPU: train = every trainer model's parameters, gradients and
  optimizer state on the device with the larger of the actor's and the critic's activations; push = trainer
  parameters (gradients and optimizer state already offloaded) + SGLang's weights + one handoff bucket + two
  copies of the largest full tensor (TP shards and their concatenation); rollout = SGLang's static pool with
  the trainer offloaded. SFT and DPO have no rollout engine: the train phase only. The native engine never
  releases memory: its full-size weights stay in every phase and its KV cache holds the rank's samples.
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
  memory by Megatron; gradient buffers are freed, not copied. With the distributed optimizer Megatron makes
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

Imports only the standard library and megarl's config, model-shape and route-size readers (no torch).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megarl.config import Config
from megarl.models.arch import ModelShape, check_layout, padded_vocab_size, read_shape
from megarl.routing import route_bytes_per_token

GIB = 2**30
RESERVE_GIB = 4.0  # CUDA contexts of trainer and SGLang scheduler (~0.5 each), NCCL communicators (1-3)
USABLE_FRACTION = 0.95  # the rest is left to allocator fragmentation
ENGINE_START_USED_GIB = 1.5  # in use when SGLang measures free memory: both CUDA contexts, its communicators
HOST_RESERVE_GIB = 8.0  # host memory per GPU of the trainer process and SGLang's scheduler and tokenizer
HOST_USABLE_FRACTION = 0.9  # the rest is left to the OS and the file cache
DEFAULT_HOST_MEM_GIB = 2048.0  # a DGX H100/H200 node: 2 TiB
DEFAULT_SEQ_TOKENS = 4096  # SFT and DPO: the longest row when --seq-tokens is not given
OFFLINE_ALGOS = ("sft", "dpo")  # trained on a fixed data set: no rollout engine, nothing offloaded
LOGITS_BYTES = 16  # per token and vocabulary entry of the TP slice, for the logprob head (see module doc)
ENTROPY_BYTES = 8  # two more fp32 tensors of that size when algo.entropy_coef > 0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4  # fp32 gradient buffers
ADAM_BYTES = 8  # two fp32 moments
MASTER_BYTES = 4  # fp32 master parameters when the model is 16-bit
REPLAY_INDEX_BYTES = 8  # the trainer's replayed expert ids are int64 indices on the device


class PlanError(ValueError):
    """A recipe or layout that cannot run on the cluster; the message names the keys and the numbers."""


# ---------------------------------------------------------------------------------------------- model


def read_model(config_json: Path) -> ModelShape:
    """The shape of the model whose HF config is `config_json`; PlanError names the file when it is not
    one megarl supports."""
    try:
        return read_shape(config_json.parent)
    except ValueError as e:
        raise PlanError(str(e)) from None


@dataclass(frozen=True)
class ParamCounts:
    """Parameters on one GPU: `dense` are sharded by the distributed optimizer over dp*cp, `expert` over
    the expert data-parallel ranks."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_params(shape: ModelShape, *, tp: int, pp: int, ep: int, stage: int,
                 value_head: bool = False, padded_vocab: int | None = None) -> ParamCounts:
    """Parameters one GPU of pipeline stage `stage` holds, tensor by tensor as GPTModel builds them
    (local or Transformer Engine spec: TE fuses the norms into the linears without changing the count).

    `value_head` is megarl's critic: untied, a [1, h] head in place of the output layer.
    `padded_vocab` defaults to Megatron's padding for `tp`."""
    h, d = shape.hidden, shape.head_dim
    vocab = padded_vocab if padded_vocab is not None else padded_vocab_size(shape.vocab_size, tp=tp)
    attention = h * (shape.heads + 2 * shape.kv_heads) * d // tp + shape.heads * d * h // tp
    if shape.qkv_bias:
        attention += (shape.heads + 2 * shape.kv_heads) * d // tp
    norms = 2 * h + (2 * d if shape.qk_norm else 0)  # input and pre-MLP norms (+ q and k norms)
    dense_layer, expert_layer = attention + norms, 0
    if shape.experts:
        dense_layer += shape.experts * h  # router, replicated over TP
        expert_layer = shape.experts // ep * 3 * h * shape.moe_ffn // tp
        if shape.shared_ffn:
            dense_layer += 3 * h * shape.shared_ffn // tp + h  # shared expert and its gate
    else:
        dense_layer += 3 * h * shape.ffn // tp  # gate and up fused, then down
    layers = shape.layers // pp
    dense, expert = layers * dense_layer, layers * expert_layer
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


# ---------------------------------------------------------------------------------------------- layout


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
class Layout:
    """The recipe's parallel layout on this cluster; dp and expert_dp are what the training world leaves."""

    world: int  # Megatron's world: ranks 0 ... world - 1 train (every rank, unless placement split)
    rollout_ranks: int  # placement split: ranks world ... world + rollout_ranks - 1 only generate; else 0
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    expert_dp: int
    vpp: int  # virtual pipeline stages per GPU (1 = none)
    micro_batches: int  # per data-parallel rank per optimizer step
    seq_len: int  # tokens per padded sequence (`sequence_tokens`)
    rollout_engines: list[int] = field(default_factory=list)  # global rank holding each SGLang engine


def _divides(number: int, divisor: int, what: str, by: str) -> None:
    if divisor <= 0 or number % divisor:
        raise PlanError(f"{what} is not divisible by {by}")


def virtual_stages(megatron: dict, *, layers: int, pp: int) -> int:
    """Virtual pipeline stages from `model.megatron` (1 when not set). Megatron's training scripts spell it
    `num_layers_per_virtual_pipeline_stage`; TransformerConfig only knows the stage count."""
    if "num_layers_per_virtual_pipeline_stage" in megatron:
        per = megatron["num_layers_per_virtual_pipeline_stage"]
        hint = f" (= layers / (pp * {per}) = {layers / (pp * per):g})" if per else ""
        raise PlanError("model.megatron.num_layers_per_virtual_pipeline_stage is not a TransformerConfig field: "
                        f"set virtual_pipeline_model_parallel_size{hint}")
    return megatron.get("virtual_pipeline_model_parallel_size") or 1


def sequence_tokens(cfg: Config, *, prompt_tokens: int, seq_tokens: int | None) -> tuple[int, str]:
    """Tokens of the longest sequence a step can hold, and where the number comes from.

    One turn: the prompt and rollout.max_new_tokens. A multi-turn environment: the prompt and env.max_tokens,
    which bounds the generated and observation tokens of all turns together (megarl.rollout.multi_turn). SFT
    and DPO: the longest tokenized row, `seq_tokens` (their loops pad to it and truncate nothing)."""
    offline = cfg.algo.name in OFFLINE_ALGOS
    if seq_tokens is not None and not offline:
        raise PlanError(f"--seq-tokens is for SFT and DPO recipes; a sequence of algo.name {cfg.algo.name} is "
                        "--prompt-tokens + rollout.max_new_tokens (env.max_tokens with a multi-turn env)")
    if offline:
        tokens = DEFAULT_SEQ_TOKENS if seq_tokens is None else seq_tokens
        given = f"--seq-tokens default {DEFAULT_SEQ_TOKENS}" if seq_tokens is None else "--seq-tokens"
        return tokens, f"{tokens} tokens, the longest {cfg.algo.name} row ({given}; rows are not truncated)"
    if cfg.env.name != "single_turn":
        if cfg.env.max_tokens is None:
            raise PlanError(f"env.max_tokens is null: a multi-turn trajectory (env.name {cfg.env.name}) has no "
                            "length bound to plan for; set it (generated and observation tokens of all turns)")
        return (prompt_tokens + cfg.env.max_tokens,
                f"{prompt_tokens + cfg.env.max_tokens} tokens = --prompt-tokens {prompt_tokens} + env.max_tokens "
                f"{cfg.env.max_tokens} (all turns of env {cfg.env.name})")
    return (prompt_tokens + cfg.rollout.max_new_tokens,
            f"{prompt_tokens + cfg.rollout.max_new_tokens} tokens = --prompt-tokens {prompt_tokens} + "
            f"rollout.max_new_tokens {cfg.rollout.max_new_tokens}")


def check_layout_for(cfg: Config, shape: ModelShape, cluster: Cluster, *, seq_len: int) -> Layout:
    """Every divisibility the launch needs, on this cluster; PlanError names both numbers.

    With placement split Megatron's world is the job's first cluster.world - placement.rollout_ranks ranks
    (megarl.loops.split), and every number the trainer divides is of that world."""
    par, world = cfg.parallel, cluster.world
    offline = cfg.algo.name in OFFLINE_ALGOS
    rollout_ranks = cfg.placement.rollout_ranks if cfg.placement.mode == "split" else 0
    where, why = f"world size = {cluster.nodes} nodes * {cluster.gpus_per_node} GPUs", ""
    if rollout_ranks:
        if rollout_ranks >= world:
            raise PlanError(f"placement.rollout_ranks = {rollout_ranks} leaves no training rank in a job of "
                            f"{world} ranks ({cluster.nodes} nodes * {cluster.gpus_per_node} GPUs)")
        world -= rollout_ranks
        why = f"; placement.rollout_ranks {rollout_ranks} of the {cluster.world} ranks only generate"
        where = f"training world size = {cluster.world} ranks - placement.rollout_ranks {rollout_ranks}"
    vpp = virtual_stages(cfg.model.megatron, layers=shape.layers, pp=par.pp)
    try:
        check_layout(shape, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, world_size=world, vpp=vpp,
                     sequence_parallel=bool(cfg.model.megatron.get("sequence_parallel")))
    except ValueError as e:
        raise PlanError(f"{e} ({where})") from None
    dp = world // (par.tp * par.pp * par.cp)
    expert_dp = world // (par.tp * par.ep * par.pp)

    prompts, micro = cfg.data.prompts_per_step, cfg.train.micro_batch_size
    size = f"training world size {world}" if rollout_ranks else f"world size {world}"
    _divides(prompts, dp, f"data.prompts_per_step {prompts}", f"the data-parallel size {dp} "
             f"({size} / (parallel.tp * parallel.pp * parallel.cp){why})")
    # sequences per prompt: RL's samples, SFT's row, DPO's chosen and rejected (megarl.loops.sft.rows_per_rank)
    match cfg.algo.name:
        case "sft":
            per_prompt, what, times = 1, "sequences", ""
        case "dpo":
            per_prompt, what, times = 2, "sequences", " * 2 (chosen and rejected)"
        case _:
            per_prompt, what, times = cfg.rollout.n_samples, "samples", " * rollout.n_samples"
    samples = prompts // dp * per_prompt
    dp_from = f", data-parallel size {dp} = {size} / (parallel.tp * parallel.pp * parallel.cp){why}" if why else ""
    _divides(samples, micro, f"{what} per data-parallel rank {samples} (data.prompts_per_step / {dp}{times}"
             f"{dp_from})", f"train.micro_batch_size = {micro}")
    micro_batches = samples // micro
    if vpp > 1:
        # Megatron's interleaved schedule runs micro-batches in groups of pp.
        _divides(micro_batches, par.pp, f"micro-batches per data-parallel rank {micro_batches}",
                 f"parallel.pp = {par.pp} (interleaved pipeline schedule)")
    generating = range(world, cluster.world) if rollout_ranks else range(cluster.world)
    engines = (rollout_engines(cfg, shape, cluster, ranks=generating)
               if cfg.rollout.engine == "sglang" and not offline else [])
    return Layout(world=world, rollout_ranks=rollout_ranks, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, dp=dp,
                  expert_dp=expert_dp, vpp=vpp, micro_batches=micro_batches, seq_len=seq_len,
                  rollout_engines=engines)


def rollout_engines(cfg: Config, shape: ModelShape, cluster: Cluster, *, ranks: range) -> list[int]:
    """Global ranks that start an SGLang engine, checked for placement and for SGLang's own TP split.

    The RL loop starts one engine on every group of `rollout.tp` consecutive ranks of `ranks`, whatever the
    trainer's layout (megarl.rollout.placement), over those ranks' GPUs: every GPU of `ranks` generates. They
    are the whole world, or with placement split its last placement.rollout_ranks ranks, a multiple of
    rollout.tp (checked by Config), so that their groups start where the world's would."""
    rtp, gpus = cfg.rollout.tp, cluster.gpus_per_node
    _divides(shape.heads, rtp, f"attention heads {shape.heads}", f"rollout.tp = {rtp}")
    if shape.kv_heads % rtp and rtp % shape.kv_heads:
        raise PlanError(f"key/value heads {shape.kv_heads} and rollout.tp = {rtp}: neither divides the other "
                        "(SGLang splits the KV heads over its TP ranks or replicates them)")
    ffn, name = (shape.moe_ffn, "expert MLP width") if shape.experts else (shape.ffn, "MLP width")
    _divides(ffn, rtp, f"{name} {ffn}", f"rollout.tp = {rtp}")
    if rtp > gpus:
        raise PlanError(f"rollout.tp = {rtp} is more than the {gpus} GPUs of a node (--gpus-per-node)")
    # an engine's GPUs must be on one node
    _divides(gpus, rtp, f"GPUs per node {gpus}", f"rollout.tp = {rtp}")
    return list(ranks[::rtp])


# ---------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class ModelMemory:
    """Bytes one trainer model holds on one GPU of the planned stage."""

    name: str  # actor, reference, critic or a reward model
    params: int
    grads: int
    optim: int
    activations: int  # peak of one training pass (0 for a frozen model)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optim


def model_state(counts: ParamCounts, *, dtype: str, trainable: bool, distributed: bool, dp: int,
                expert_dp: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes of `counts` parameters on one GPU (see module doc)."""
    params = counts.total * DTYPE_BYTES[dtype]
    if not trainable:
        return params, 0, 0
    per_param = ADAM_BYTES + (MASTER_BYTES if dtype != "float32" else 0)
    if distributed:
        optim = per_param * (-(-counts.dense // dp) + -(-counts.expert // expert_dp))
    else:
        optim = per_param * counts.total
    return params, GRAD_BYTES * counts.total, optim


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


def activation_bytes(shape: ModelShape, layout: Layout, *, stage: int, micro_batch_size: int,
                     megatron: dict, act_bytes: int, head_bytes_per_token: float) -> int:
    """Peak activation bytes of one training pass on one GPU of pipeline stage `stage`."""
    tokens = micro_batch_size * layout.seq_len / layout.cp
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


def sglang_kv_bytes_per_token(shape: ModelShape, *, dtype: str, tp: int = 1) -> int:
    """Bytes of one token's keys and values on one GPU of an SGLang engine of `tp` GPUs."""
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
    return pool // sglang_kv_bytes_per_token(shape, dtype=dtype, tp=tp)


def rollout_memory(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster) -> Rollout:
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    full = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size).total
    if cfg.rollout.engine == "sglang":
        rtp = cfg.rollout.tp
        per_token = sglang_kv_bytes_per_token(shape, dtype=cfg.model.dtype, tp=rtp)
        weights = full * dtype_bytes // rtp
        # SGLang takes mem_fraction of the memory free when its scheduler starts, before the trainer's
        # models exist (megarl.loops.rl_run.build_run) or on a rollout rank's GPU, which holds no trainer
        # (placement split): the GPU less the engines' contexts.
        free = (cluster.gpu_mem_gib - ENGINE_START_USED_GIB) * GIB
        pool = dict(free_bytes=free, mem_fraction=cfg.rollout.mem_fraction, weight_bytes=weights)
        kv = sglang_pool_bytes(**pool)
        static = int(cfg.rollout.mem_fraction * free)  # the weights and the KV cache
        tokens = sglang_pool_tokens(shape, **pool, dtype=cfg.model.dtype, tp=rtp)
        engines = len(layout.rollout_engines)
    else:  # native: a whole transformers model on the first rank of every group of rollout.tp ranks
        rtp, engines = 1, (layout.rollout_ranks or cluster.world) // cfg.rollout.tp
        per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes
        weights = full * dtype_bytes
        samples = -(-cfg.data.prompts_per_step * cfg.rollout.n_samples // engines)  # the step's samples, split
        kv = samples * layout.seq_len * per_token
        static = weights + kv
        tokens = kv // per_token
    return Rollout(engine=cfg.rollout.engine, gpus=rtp, engines=engines, weights=weights, static=static,
                   kv_bytes=kv, kv_bytes_per_token=per_token, kv_tokens=tokens, samples=tokens // layout.seq_len)


@dataclass(frozen=True)
class Routing:
    """The MoE routes of one RL step (megarl.routing; module doc)."""

    bytes_per_token: int  # host bytes of one token's routes: MoE layers x top-k expert ids
    tokens_per_rank: int  # tokens of the samples one data-parallel rank holds (padded to `sequence_tokens`)
    host_per_rank: int  # bytes per GPU: its rank's routes, in the rollout batch on the host
    host_per_node: int  # bytes per node: every training GPU's process holds its rank's routes
    device_train: int  # bytes per GPU in the train phase: one micro-batch's routes as int64 indices


def routing_memory(cfg: Config, shape: ModelShape, layout: Layout, cluster: Cluster) -> Routing | None:
    """The step's MoE routes per GPU and per node; None for a dense model or an offline recipe (no rollout)."""
    if not shape.is_moe or cfg.algo.name in OFFLINE_ALGOS:
        return None
    per_token = route_bytes_per_token(moe_layers=shape.layers, top_k=shape.topk, experts=shape.experts)
    tokens = cfg.data.prompts_per_step * cfg.rollout.n_samples // layout.dp * layout.seq_len
    # One micro-batch as the trainer runs it (its CP slice), every MoE layer of the stage, int64 ids.
    micro_tokens = cfg.train.micro_batch_size * layout.seq_len // layout.cp
    device = micro_tokens * shape.topk * (shape.layers // layout.pp) * REPLAY_INDEX_BYTES
    # Ranks fill the nodes in order, so the first node holds the most training ranks.
    trainers = min(cluster.gpus_per_node, layout.world)
    return Routing(bytes_per_token=per_token, tokens_per_rank=tokens, host_per_rank=tokens * per_token,
                   host_per_node=trainers * tokens * per_token, device_train=device)


@dataclass(frozen=True)
class HostMemory:
    """Host memory of the trainer state offloaded while the rollout engines generate (megarl.engine.offload;
    none with placement split). Per-GPU numbers are those of the pipeline stage that holds the most."""

    params: int  # bytes per GPU: every trainer model's parameters, in pinned buffers
    optim: int  # bytes per GPU: the trained models' optimizer state (moments, fp32 master copy)
    first_offload: int  # bytes per GPU: the pageable copy of one parameter buffer Megatron pins through, once
    routes: int  # bytes per GPU: the step's MoE routes of its data-parallel rank (0 for a dense model)
    per_node: int  # bytes on the fullest node, HOST_RESERVE_GIB per GPU included
    limit: int  # usable bytes per node


def host_memory(cfg: Config, cluster: Cluster, layout: Layout, stages: list[list[ModelMemory]],
                buffers: list[int], routes: int = 0) -> HostMemory:
    """What the RL loop moves to the host, per GPU of each pipeline stage (`stages[s]`: its models; `buffers[s]`:
    the bytes of its largest DDP parameter buffer), with the `routes` bytes every training GPU's process holds
    while the trainer is offloaded, summed over the GPUs of the fullest node. SFT and DPO offload nothing, and
    neither does placement split, whose rollout GPUs hold only the processes' reserve."""
    limit = int(HOST_USABLE_FRACTION * cluster.host_mem_gib * GIB)
    reserve = int(HOST_RESERVE_GIB * GIB)
    if cfg.algo.name in OFFLINE_ALGOS:
        return HostMemory(params=0, optim=0, first_offload=0, routes=0, per_node=cluster.gpus_per_node * reserve,
                          limit=limit)
    if layout.rollout_ranks:  # placement split: the trainer's state never leaves its GPUs
        per_gpu = [(0, 0, 0, routes)] * layout.pp
    else:
        per_gpu = [(sum(m.params for m in models), sum(m.optim for m in models),
                    buffers[s] if cfg.optim.distributed else 0, routes) for s, models in enumerate(stages)]
    # Megatron's rank order puts pipeline stages outermost: ranks [s * world/pp, (s+1) * world/pp) are stage s.
    per_stage = layout.world // layout.pp
    nodes = [sum((sum(per_gpu[rank // per_stage]) if rank < layout.world else 0) + reserve
                 for rank in range(n * cluster.gpus_per_node, (n + 1) * cluster.gpus_per_node))
             for n in range(cluster.nodes)]
    params, optim, first, routes = max(per_gpu, key=sum)
    return HostMemory(params=params, optim=optim, first_offload=first, routes=routes, per_node=max(nodes),
                      limit=limit)


@dataclass(frozen=True)
class Plan:
    recipe: str
    cluster: Cluster
    model: dict  # what the estimate read from config.json
    layout: Layout
    stage: int  # the pipeline stage whose GPUs hold the most
    models: list[ModelMemory]
    rollout: Rollout | None  # None for SFT and DPO
    routing: Routing | None  # None for a dense model, SFT and DPO
    phases: dict[str, int]  # bytes per GPU in each phase, reserve included (placement split: per training GPU)
    rollout_phases: dict[str, int]  # placement split: bytes per rollout GPU in each phase; else empty
    limit: int  # usable bytes per GPU
    host: HostMemory
    assumptions: list[str]

    @property
    def peak(self) -> int:
        return max([*self.phases.values(), *self.rollout_phases.values()])

    @property
    def problems(self) -> list[str]:
        """Why the plan does not fit, one sentence each; empty when it fits."""
        split = self.layout.rollout_ranks > 0
        kinds = [("training GPUs, " if split else "", self.phases), ("rollout GPUs, ", self.rollout_phases)]
        out = [f"{kind}{name}: {_gib(nbytes)} GiB per GPU, more than the {_gib(self.limit)} GiB usable"
               for kind, phases in kinds for name, nbytes in phases.items() if nbytes > self.limit]
        r = self.rollout
        if r is not None and r.samples < 1:
            out.append(f"rollout: the KV cache holds no full-length sample of {self.layout.seq_len} tokens "
                       f"({_gib(r.kv_bytes)} GiB per GPU): raise rollout.mem_fraction or rollout.tp")
        h = self.host
        if h.per_node > h.limit:
            routes = (f" and the step's MoE routes ({_gib(self.routing.host_per_node)} GiB per node)"
                      if self.routing is not None else "")
            if split:  # nothing is offloaded: the processes' reserve and the routes
                what = f"the processes{routes} take"
                advice = "placement split offloads nothing" + (
                    "; use fewer or shorter samples per step, or more training ranks (the routes are split over "
                    "the data-parallel ranks)" if routes else "")
            elif routes:
                what = f"the offloaded trainer state{routes} take"
                advice = ("use more nodes (the optimizer state and the routes are split over the data-parallel "
                          "ranks), or fewer or shorter samples per step")
            else:
                what = "the offloaded trainer state takes"
                advice = ("use more nodes, or more model parallelism (the optimizer state is sharded over the "
                          "data-parallel ranks)")
            out.append(f"host: {what} {_gib(h.per_node)} GiB per node, more than the {_gib(h.limit)} GiB usable of "
                       f"--host-mem-gb {self.cluster.host_mem_gib:g}: {advice}")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems


def _largest_tensor(shape: ModelShape) -> int:
    """Elements of the largest full HF tensor the weight push gathers (fused QKV and gate/up included)."""
    h, d = shape.hidden, shape.head_dim
    mlp = 2 * (shape.moe_ffn if shape.experts else shape.ffn) * h
    return max(shape.vocab_size * h, h * (shape.heads + 2 * shape.kv_heads) * d, mlp, 2 * shape.shared_ffn * h)


def trainer_roles(cfg: Config) -> list[tuple[str, bool, bool]]:
    """(name, trainable, value_head) of every model the recipe's loop builds on each GPU (megarl.loops)."""
    match cfg.algo.name:
        case "sft":
            return [("actor", True, False)]
        case "dpo":
            return [("actor", True, False), ("reference", False, False)]
    roles = [("actor", True, False)]
    if cfg.algo.kl_coef > 0:
        roles.append(("reference", False, False))
    if cfg.algo.name == "ppo":
        roles.append(("critic", True, True))
    return roles


def reward_model_shapes(cfg: Config, shape: ModelShape) -> list[tuple[str, ModelShape]]:
    """(name, shape) of every reward-model term (`reward.terms[i]`, kind reward_model): its checkpoint's
    config.json when the checkpoint is on this machine, else the policy's architecture."""
    out = []
    for i, term in enumerate(cfg.reward.terms):
        if term.kind == "reward_model":
            config = Path(term.path or "") / "config.json"
            out.append((f"reward_model (reward.terms[{i}])", read_model(config) if config.is_file() else shape))
    return out


def plan(cfg: Config, shape: ModelShape, cluster: Cluster, *, recipe: str = "",
         prompt_tokens: int = 1024, seq_tokens: int | None = None) -> Plan:
    """Check the layout (PlanError) and estimate every phase's bytes per GPU on the most-loaded stage, and
    the host memory of the fullest node.

    PPO's critic is planned with the policy's architecture (its default checkpoint) and a value head. Reward
    models are frozen scalar-head models at the trainer's layout that stay on the device in every phase
    (megarl.loops.rl_run.build_run: their scores are needed as generation ends); they are not offloaded."""
    seq_len, seq_source = sequence_tokens(cfg, prompt_tokens=prompt_tokens, seq_tokens=seq_tokens)
    layout = check_layout_for(cfg, shape, cluster, seq_len=seq_len)
    dtype, optim, megatron = cfg.model.dtype, cfg.optim, cfg.model.megatron
    dtype_bytes = DTYPE_BYTES[dtype]
    rollout = None if cfg.algo.name in OFFLINE_ALGOS else rollout_memory(cfg, shape, layout, cluster)
    routing = routing_memory(cfg, shape, layout, cluster)
    route_device = routing.device_train if routing is not None else 0
    logits = LOGITS_BYTES + (ENTROPY_BYTES if cfg.algo.entropy_coef > 0 else 0)
    vocab_slice = padded_vocab_size(shape.vocab_size, tp=layout.tp) // layout.tp
    state_args = dict(dtype=dtype, distributed=optim.distributed, dp=layout.dp * layout.cp,
                      expert_dp=layout.expert_dp)
    reserve = int(RESERVE_GIB * GIB)
    gathered = 2 * _largest_tensor(shape) * dtype_bytes
    reward_shapes = [] if rollout is None else reward_model_shapes(cfg, shape)

    stages, buffers, best = [], [], None
    for stage in range(layout.pp):
        models, largest_buffer = [], 0
        for name, trainable, value_head in trainer_roles(cfg):
            counts = stage_params(shape, tp=layout.tp, pp=layout.pp, ep=layout.ep, stage=stage,
                                  value_head=value_head)
            params, grads, opt = model_state(counts, trainable=trainable, **state_args)
            acts = activation_bytes(shape, layout, stage=stage, megatron=megatron,
                                    micro_batch_size=cfg.train.micro_batch_size, act_bytes=dtype_bytes,
                                    head_bytes_per_token=0 if value_head else logits * vocab_slice) \
                if trainable else 0
            models.append(ModelMemory(name, params, grads, opt, acts))
            if trainable:  # a DDP buffer per model for dense and one for expert parameters
                largest_buffer = max(largest_buffer, counts.dense * dtype_bytes, counts.expert * dtype_bytes)
        stages.append(models)  # what the offload moves to the host
        buffers.append(largest_buffer)
        judges = [ModelMemory(name, stage_params(rshape, tp=layout.tp, pp=layout.pp, ep=layout.ep, stage=stage,
                                                 value_head=True).total * dtype_bytes, 0, 0, 0)
                  for name, rshape in reward_shapes]
        resident = sum(m.params for m in judges)  # in every phase
        states = sum(m.state for m in models)
        trainer_params = sum(m.params for m in models)
        if rollout is None:  # SFT, DPO: the trainer alone, never offloaded
            phases = {"train": states + max(m.activations for m in models) + reserve}
        elif layout.rollout_ranks:  # placement split: no engine here, nothing offloaded; rank 0 sends the push
            phases = {"train": states + max(m.activations for m in models) + route_device + reserve,
                      "push": states + cfg.rollout.bucket_bytes + gathered + reserve}
        elif rollout.engine == "native":  # it never lets go: its weights and KV cache stay in every phase
            phases = {"train": states + max(m.activations for m in models) + route_device + rollout.static + reserve,
                      "push": trainer_params + rollout.static + cfg.rollout.bucket_bytes + gathered + reserve,
                      "rollout": rollout.static + reserve}
        else:  # every GPU of every stage belongs to an SGLang engine
            phases = {"train": states + max(m.activations for m in models) + route_device + reserve,
                      "push": trainer_params + rollout.weights + cfg.rollout.bucket_bytes + gathered + reserve,
                      "rollout": rollout.static + reserve}
        phases = {name: nbytes + resident for name, nbytes in phases.items()}
        if best is None or max(phases.values()) > max(best[2].values()):
            best = (stage, models + judges, phases)
    stage, models, phases = best
    rollout_phases = {}
    if layout.rollout_ranks:  # an engine's GPU, SGLang or native: its static memory, and a bucket in the push
        rollout_phases = {"rollout": rollout.static + reserve,
                          "push": rollout.static + cfg.rollout.bucket_bytes + reserve}
    total = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size).total
    model = dict(arch=shape.arch, params=total, layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                 kv_heads=shape.kv_heads, vocab_size=shape.vocab_size, experts=shape.experts,
                 topk=shape.topk, moe_ffn=shape.moe_ffn, shared_ffn=shape.shared_ffn)
    return Plan(recipe=recipe, cluster=cluster, model=model, layout=layout, stage=stage, models=models,
                rollout=rollout, routing=routing, phases=phases, rollout_phases=rollout_phases,
                limit=int(USABLE_FRACTION * cluster.gpu_mem_gib * GIB),
                host=host_memory(cfg, cluster, layout, stages, buffers,
                                 routes=routing.host_per_rank if routing is not None else 0),
                assumptions=assumptions(cfg, layout, seq_source=seq_source, experts=shape.is_moe,
                                        routing=routing))


def assumptions(cfg: Config, layout: Layout, *, seq_source: str, experts: bool,
                routing: Routing | None = None) -> list[str]:
    megatron = cfg.model.megatron
    recompute = megatron.get("recompute_granularity") or "none"
    if recompute == "full":
        recompute += f" ({megatron.get('recompute_method')}, units of {megatron.get('recompute_num_layers')} layer(s))"
    offline, split = cfg.algo.name in OFFLINE_ALGOS, layout.rollout_ranks > 0
    if offline:
        phases = (f"{cfg.algo.name} has no rollout engine: one phase, train, with every model resident"
                  + (" (the frozen reference beside the actor)" if cfg.algo.name == "dpo" else ""))
        host = f"host: nothing offloaded; {HOST_RESERVE_GIB:g} GiB per GPU for the processes"
    elif split:
        phases = (f"placement split, nothing offloaded: training GPUs ({_ranks(0, layout.world)}) hold every "
                  "trainer model all the time and no rollout engine: train (all trainer models resident), push "
                  "(training rank 0: the same state + one bucket + 2 copies of the largest tensor, broadcast to the "
                  f"engines); rollout GPUs ({_ranks(layout.world, layout.world + layout.rollout_ranks)}) hold the "
                  "engine alone: rollout (its static memory), push (+ the one bucket it receives)")
        host = (f"host, per node: nothing offloaded (placement split); {HOST_RESERVE_GIB:g} GiB per GPU for the "
                f"processes; usable = {HOST_USABLE_FRACTION:.0%} of --host-mem-gb")
    else:
        phases = ("phases as the RL loop orders them: train (all trainer models resident), push (trainer parameters "
                  "+ rollout weights + one bucket + 2 copies of the largest tensor), rollout (trainer offloaded); "
                  "a rollout engine on every GPU")
        host = ("host, per node: every trainer model's parameters pinned, the trained models' optimizer state, "
                + ("one parameter buffer's pageable copy on the first offload, " if cfg.optim.distributed else "")
                + f"{HOST_RESERVE_GIB:g} GiB per GPU for the processes; usable = {HOST_USABLE_FRACTION:.0%} of "
                "--host-mem-gb")
    out = [
        f"sequences padded to {seq_source}",
        f"parameters in model.dtype {cfg.model.dtype}; gradients fp32; Adam moments fp32"
        + ("" if cfg.model.dtype == "float32" else " plus an fp32 master copy")
        + (f", sharded over dp*cp = {layout.dp * layout.cp}" + (f" (experts: {layout.expert_dp})" if experts else "")
           if cfg.optim.distributed else ", not sharded (optim.distributed: false)"),
        f"activations: Korthikanti et al. 2022 generalized to GQA/SwiGLU/experts; recompute {recompute}; "
        f"sequence_parallel {bool(megatron.get('sequence_parallel'))}; fused attention (no seq^2 term); "
        "balanced expert routing",
        f"logprob head: {LOGITS_BYTES} bytes per token and vocabulary entry of the TP slice"
        + ("" if offline else f" (+{ENTROPY_BYTES} with an entropy bonus)"),
        phases,
    ]
    if not offline and any(term.kind == "reward_model" for term in cfg.reward.terms):
        out.append("reward models: frozen, a scalar head, at the trainer's layout, resident in every phase (never "
                   "offloaded); a checkpoint not on this machine is planned with the policy's architecture")
    if not offline and cfg.rollout.engine == "sglang":
        out.append(f"SGLang's pool: rollout.mem_fraction {cfg.rollout.mem_fraction:g} of the memory free when the "
                   f"engine starts (the GPU less {ENGINE_START_USED_GIB:g} GiB of contexts), "
                   + ("on a GPU no trainer uses" if split else "before the trainer's models")
                   + "; the KV cache is what its weights leave")
    if routing is not None:
        out.append(f"MoE routes: {routing.bytes_per_token} bytes per token (top-k expert ids of every MoE layer), "
                   "captured on every MoE run whatever algo.router_replay says; on the host, each "
                   + ("training " if split else "") + "GPU's process "
                   f"holds its data-parallel rank's {routing.tokens_per_rank} tokens (data.prompts_per_step x "
                   "rollout.n_samples / dp, padded) from generation to the end of training"
                   + ("" if split else ", beside the offloaded trainer state")
                   + "; on the device in train, one micro-batch's routes as int64 indices "
                   "[tokens, top_k] per MoE layer of the stage (router replay), counted whether or not replay is on")
    return out + [
        host,
        f"reserve {RESERVE_GIB:g} GiB per GPU for CUDA contexts and NCCL; usable = {USABLE_FRACTION:.0%} of the GPU",
        "not counted: DDP bucket padding, expert load imbalance, SGLang CUDA graphs beyond the reserve"
        + (", the batches generated ahead (algo.max_staleness) waiting in torchrun's store on its host"
           if split else ""),
    ]


# ---------------------------------------------------------------------------------------------- output


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def _ranks(start: int, stop: int) -> str:
    return f"rank {start}" if stop - start == 1 else f"ranks {start}-{stop - 1}"


def render_table(p: Plan) -> str:
    c, lay, r, m, h = p.cluster, p.layout, p.rollout, p.model, p.host
    split = lay.rollout_ranks > 0
    trainers, generators = _ranks(0, lay.world), _ranks(lay.world, c.world)
    experts = (f", {m['experts']} experts top-{m['topk']} (width {m['moe_ffn']})" if m["experts"] else "")
    if r is None:
        rollout = "rollout: none (trained on a fixed data set)"
    else:
        rollout = (f"rollout: {r.engines} {r.engine} engine(s) x {r.gpus} GPU(s)"
                   + (f" on the rollout GPUs ({generators})" if split else "")
                   + f"; weights {_gib(r.weights)} GiB/GPU, "
                   f"KV cache {_gib(r.kv_bytes)} GiB = {r.kv_tokens} tokens = {r.samples} full-length samples")
    world = f"training world {lay.world}" if split else f"world {c.world}"
    per_gpu = f"GiB per training GPU (stage {p.stage})" if split else f"GiB per GPU (pipeline stage {p.stage})"
    lines = [
        f"megarl plan: {p.recipe} on {c.nodes} node(s) x {c.gpus_per_node} GPUs, {c.gpu_mem_gib:g} GiB each, "
        f"{c.host_mem_gib:g} GiB host memory per node",
        f"model: {m['arch']}, {m['params'] / 1e9:.2f}B parameters, {m['layers']} layers, hidden {m['hidden']}, "
        f"{m['heads']} heads / {m['kv_heads']} query groups{experts}",
        f"layout: {world} = tp {lay.tp} x pp {lay.pp} x cp {lay.cp} x dp {lay.dp}"
        + (f"; experts: tp {lay.tp} x ep {lay.ep} x pp {lay.pp} x expert-dp {lay.expert_dp}" if m["experts"] else "")
        + (f"; {lay.vpp} virtual stages" if lay.vpp > 1 else "")
        + (f" ({trainers}); placement split: {generators} of world {c.world} only generate" if split else ""),
        f"batch: {lay.micro_batches} micro-batches per data-parallel rank, {lay.seq_len} tokens per sequence",
        rollout,
        "",
        f"{per_gpu:<30}  params   grads   optim   activations",
    ]
    for mm in p.models:
        lines.append(f"  {mm.name:<30}{_gib(mm.params):>7} {_gib(mm.grads):>7} {_gib(mm.optim):>7} "
                     f"{_gib(mm.activations):>13}")
    lines.append(f"  {'reserve (contexts, NCCL)':<30}{RESERVE_GIB:>7.1f}")
    lines.append("")
    lines.append(f"phase      GiB per GPU   (usable {_gib(p.limit)})")
    kinds = [(f"training GPUs ({trainers}): no rollout engine, nothing offloaded", p.phases),
             (f"rollout GPUs ({generators}): the engine alone", p.rollout_phases)] if split else [("", p.phases)]
    for title, phases in kinds:
        lines += [title] if title else []
        for name, nbytes in phases.items():
            lines.append(f"  {name:<9}{_gib(nbytes):>12}   {'ok' if nbytes <= p.limit else 'DOES NOT FIT'}")
    lines.append(f"host memory per node: {_gib(h.per_node)} GiB (usable {_gib(h.limit)})   "
                 f"{'ok' if h.per_node <= h.limit else 'DOES NOT FIT'}")
    routes = f"MoE routes {_gib(h.routes)}, " if p.routing else ""
    if split:
        lines.append(f"  per GPU: nothing offloaded (placement split), {routes}processes {HOST_RESERVE_GIB:g}")
    elif r is not None:
        lines.append(f"  per GPU: parameters {_gib(h.params)} pinned, optimizer {_gib(h.optim)}, first offload "
                     f"{_gib(h.first_offload)}, {routes}processes {HOST_RESERVE_GIB:g}")
    if p.routing is not None:
        rt = p.routing
        lines.append(f"MoE routes: {rt.bytes_per_token} bytes/token; host {rt.host_per_rank / GIB:.2f} GiB per rank "
                     f"({rt.tokens_per_rank} tokens), {rt.host_per_node / GIB:.2f} GiB per node; device "
                     f"{rt.device_train / GIB:.3f} GiB per GPU in train (one micro-batch, int64)")
    peaks = (f": training GPUs {_gib(max(p.phases.values()))}, rollout GPUs {_gib(max(p.rollout_phases.values()))}"
             if split else "")
    lines.append(f"fits: {'yes' if p.fits else 'no'} (peak {_gib(p.peak)} of {_gib(p.limit)} GiB usable per GPU"
                 f"{peaks})")
    lines += [f"  - {problem}" for problem in p.problems]
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in p.assumptions]
    return "\n".join(lines)


def to_json(p: Plan) -> str:
    """The plan as JSON. `phases_gib` are the phases of the GPUs that train (all of them unless placement is
    split); with placement split `gpus` gives each kind, training and rollout, its ranks, phases and peak
    (null otherwise)."""
    lay, split = p.layout, p.layout.rollout_ranks > 0

    def kind(first: int, stop: int, phases: dict[str, int]) -> dict:
        return {"ranks": [first, stop - 1], "count": stop - first,
                "phases_gib": {k: v / GIB for k, v in phases.items()}, "peak_gib": max(phases.values()) / GIB}

    gpus = {"training": kind(0, lay.world, p.phases),
            "rollout": kind(lay.world, p.cluster.world, p.rollout_phases)} if split else None
    out = {
        "recipe": p.recipe, "fits": p.fits, "problems": p.problems, "peak_gib": p.peak / GIB,
        "usable_gib": p.limit / GIB, "cluster": asdict(p.cluster), "model": p.model, "layout": asdict(p.layout),
        "stage": p.stage, "models": [{**asdict(m), "state": m.state} for m in p.models],
        "rollout": asdict(p.rollout) if p.rollout is not None else None,
        "routing": asdict(p.routing) if p.routing is not None else None,
        "phases_gib": {k: v / GIB for k, v in p.phases.items()},
        "gpus": gpus,
        "host": {**asdict(p.host), "per_node_gib": p.host.per_node / GIB, "usable_gib": p.host.limit / GIB},
        "assumptions": p.assumptions,
    }
    return json.dumps(out, indent=2)
