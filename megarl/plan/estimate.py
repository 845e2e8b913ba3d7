"""`megarl plan`'s verdict on one recipe and cluster: the layout (megarl.layout, as launch checks it), the
sequence length to plan for, and every phase's bytes per GPU on the most-loaded pipeline stage with the host
memory of the fullest node (megarl.plan.memory), gathered into a `Plan` that says whether it fits and why not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megarl.config import Config, RecipeError
from megarl.job import Job, ModelRole, model_shape
from megarl.layout import Layout
from megarl.models.arch import ModelShape, padded_vocab_size
from megarl.plan.memory import (DTYPE_BYTES, ENGINE_START_USED_GIB, ENTROPY_BYTES, GIB, HOST_RESERVE_GIB,
                                HOST_USABLE_FRACTION, LOGITS_BYTES, OFFLOAD_GRAD_BYTES, RESERVE_GIB,
                                USABLE_FRACTION, Cluster, HostMemory, ModelMemory, Rollout, Routing,
                                activation_bytes, host_memory, largest_tensor, lora_params, model_state,
                                rollout_memory, routing_memory, stage_params)

DEFAULT_SEQ_TOKENS = 4096  # SFT and DPO: the longest row when --seq-tokens is not given


class PlanError(ValueError):
    """A recipe or layout that cannot run on the cluster; the message names the keys and the numbers."""


def read_model(config_json: Path) -> ModelShape:
    """The shape of the model whose HF config is `config_json`; PlanError names the file when it is not
    one megarl supports."""
    try:
        return model_shape(config_json.parent)
    except RecipeError as e:
        raise PlanError(str(e)) from None


def sequence_tokens(cfg: Config, *, prompt_tokens: int, seq_tokens: int | None) -> tuple[int, str]:
    """Tokens of the longest sequence a step can hold, and where the number comes from.

    One turn: the prompt and rollout.max_new_tokens. A multi-turn environment: the prompt and env.max_tokens,
    which bounds the generated and observation tokens of all turns together (megarl.envs.trajectories). SFT
    and DPO: the longest tokenized row, `seq_tokens` (their loops pad to it and truncate nothing)."""
    offline = cfg.algo.traits.offline
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


@dataclass(frozen=True)
class Plan:
    recipe: str
    cluster: Cluster
    job: Job  # the run as launch resolves it on the cluster (megarl.job)
    model: dict  # what the estimate read from config.json
    layout: Layout
    seq_len: int  # tokens per padded sequence (`sequence_tokens`)
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
        out = [f"{kind}{name}: {gib(nbytes)} GiB per GPU, more than the {gib(self.limit)} GiB usable"
               for kind, phases in kinds for name, nbytes in phases.items() if nbytes > self.limit]
        r = self.rollout
        if r is not None and r.samples < 1:
            # twice the rollout.tp halves each GPU's share of the weights (past a node, on whole nodes)
            more = 2 * r.gpus
            fix = (f"raise rollout.mem_fraction or rollout.tp (rollout.tp = {more}: "
                   f"{gib(r.weights * r.gpus // more)} GiB of weights per GPU)")
            out.append(f"rollout: the KV cache holds no full-length sample of {self.seq_len} tokens "
                       f"({gib(r.kv_bytes)} GiB per GPU): {fix}")
        h = self.host
        if h.per_node > h.limit:
            routes = (f" and the step's MoE routes ({gib(self.routing.host_per_node)} GiB per node)"
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
            if h.kept:
                advice += (f"; optim.cpu_offload {self.job.cfg.optim.cpu_offload:g} keeps {gib(h.kept)} GiB per GPU "
                           "there in every phase, with a copy of its gradients: a smaller share leaves more of the "
                           "optimizer state on the GPUs")
            out.append(f"host: {what} {gib(h.per_node)} GiB per node, more than the {gib(h.limit)} GiB usable of "
                       f"--host-mem-gb {self.cluster.host_mem_gib:g}: {advice}")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems


def trainer_models(job: Job) -> list[ModelRole]:
    """The models of the run's cast (megarl.job) that the trainer wakes and parks: every one but the reward
    models an RL run scores with (frozen, resident in every phase) and the LoRA reference, which is the actor."""
    return [role for role in job.cast if not role.shares_actor and (role.name != "reward_model" or role.trainable)]


def judges(job: Job) -> list[ModelRole]:
    """The frozen reward models of an RL run's reward terms."""
    return [role for role in job.cast if role.name == "reward_model" and not role.trainable]


def plan(cfg: Config, shape: ModelShape, cluster: Cluster, *, recipe: str = "",
         prompt_tokens: int = 1024, seq_tokens: int | None = None, job: Job | None = None) -> Plan:
    """Check the layout (PlanError) and estimate every phase's bytes per GPU on the most-loaded stage, and
    the host memory of the fullest node.

    The models are the run's cast (megarl.job.Job.of, as launch resolves it on this cluster's ranks; `job`: one
    already resolved for them), each at its checkpoint's architecture where its config.json is on this machine
    and the policy's otherwise. Reward models are frozen scalar-head models at the trainer's layout that stay on
    the device in every phase (megarl.loops.rl_run.build_run: their scores are needed as generation ends); they
    are not offloaded."""
    seq_len, seq_source = sequence_tokens(cfg, prompt_tokens=prompt_tokens, seq_tokens=seq_tokens)
    try:  # the run launch resolves, on this cluster's ranks
        job = job or Job.of(cfg, world=cluster.world, ranks_per_node=cluster.gpus_per_node, shape=shape,
                            planning=True)
    except RecipeError as e:
        raise PlanError(str(e)) from None
    layout = job.layout
    dtype, optim = cfg.model.dtype, cfg.optim
    dtype_bytes = DTYPE_BYTES[dtype]
    rollout = None if cfg.algo.traits.offline else rollout_memory(cfg, shape, layout, cluster, seq_len=seq_len)
    routing = routing_memory(cfg, shape, layout, cluster, seq_len=seq_len)
    route_device = routing.device_train if routing is not None else 0
    state_args = dict(dtype=dtype, distributed=optim.distributed, dp=layout.dp * layout.cp,
                      expert_dp=layout.expert_dp, cpu_offload=optim.cpu_offload)
    reserve = int(RESERVE_GIB * GIB)
    gathered = 2 * largest_tensor(shape) * dtype_bytes
    # one bucket in flight: rollout.bucket_bytes, or the whole model where it is smaller
    bucket = min(cfg.rollout.bucket_bytes, stage_params(shape, tp=1, pp=1, ep=1, stage=0,
                                                        padded_vocab=shape.vocab_size).total * dtype_bytes)

    stages, buffers, best = [], [], None
    for stage in range(layout.pp):
        models, largest_buffer = [], 0
        for role in trainer_models(job):
            name, trainable, value_head = role.name, role.trainable, role.value_head
            counts = stage_params(role.shape, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, stage=stage,
                                  value_head=value_head)
            adapters = 0
            if role.lora is not None:
                adapters = lora_params(shape, cfg.model.lora, tp=layout.tp, pp=layout.pp, ep=layout.ep)
            params, grads, opt, host_opt = model_state(counts, trainable=trainable, adapters=adapters,
                                                       **state_args)
            acts = training_activations(cfg, shape, layout, stage=stage, seq_len=seq_len, value_head=value_head) \
                if trainable else 0
            models.append(ModelMemory(name, params, grads, opt, acts, host_opt))
            if adapters:  # DDP's buffers hold what trains
                largest_buffer = max(largest_buffer, adapters * dtype_bytes)
            elif trainable:  # a DDP buffer per model for dense and one for expert parameters
                largest_buffer = max(largest_buffer, counts.dense * dtype_bytes, counts.expert * dtype_bytes)
        stages.append(models)  # what the offload moves to the host
        buffers.append(largest_buffer)
        scorers = [ModelMemory(f"reward_model ({role.key.removesuffix('.path')})",
                               stage_params(role.shape, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
                                            stage=stage, value_head=True).total * dtype_bytes, 0, 0, 0)
                   for role in judges(job)]
        resident = sum(m.params for m in scorers)  # in every phase
        states = sum(m.state for m in models)
        trainer_params = sum(m.params for m in models)
        if rollout is None:  # SFT, DPO: the trainer alone, never offloaded
            phases = {"train": states + max(m.activations for m in models) + reserve}
        elif layout.rollout_ranks:  # placement split: no engine here, nothing offloaded; rank 0 sends the push
            phases = {"train": states + max(m.activations for m in models) + route_device + reserve,
                      "push": states + bucket + gathered + reserve}
        else:  # an engine's GPU: it gives back its KV cache, and its weights unless adapters alone arrive
            kept = rollout.weights if cfg.rollout.lora_sync == "adapter" else 0
            phases = {"train": states + max(m.activations for m in models) + route_device + kept + reserve,
                      "push": trainer_params + rollout.weights + bucket + gathered + reserve,
                      "rollout": rollout.static + reserve}
        phases = {name: nbytes + resident for name, nbytes in phases.items()}
        if best is None or max(phases.values()) > max(best[2].values()):
            best = (stage, models + scorers, phases)
    stage, models, phases = best
    rollout_phases = {}
    if layout.rollout_ranks:  # an engine's GPU, SGLang or native: its static memory, and a bucket in the push
        rollout_phases = {"rollout": rollout.static + reserve,
                          "push": rollout.static + bucket + reserve}
    total = stage_params(shape, tp=1, pp=1, ep=1, stage=0, padded_vocab=shape.vocab_size).total
    model = dict(arch=shape.arch, params=total, layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                 kv_heads=shape.kv_heads, vocab_size=shape.vocab_size, experts=shape.experts,
                 topk=shape.topk, moe_ffn=shape.moe_ffn, shared_ffn=shape.shared_ffn)
    return Plan(recipe=recipe, cluster=cluster, job=job, model=model, layout=layout, seq_len=seq_len, stage=stage,
                models=models, rollout=rollout, routing=routing, phases=phases, rollout_phases=rollout_phases,
                limit=int(USABLE_FRACTION * cluster.gpu_mem_gib * GIB),
                host=host_memory(cfg, cluster, layout, stages, buffers,
                                 routes=routing.host_per_rank if routing is not None else 0),
                assumptions=assumptions(cfg, layout, seq_source=seq_source, experts=shape.is_moe,
                                        routing=routing)
                + ([] if cfg.algo.traits.offline else [trained_tokens(cfg, layout, prompt_tokens=prompt_tokens,
                                                                      seq_len=seq_len)]))


def training_activations(cfg: Config, shape: ModelShape, layout: Layout, *, stage: int, seq_len: int,
                         value_head: bool = False, packed_tokens: int | None = None) -> int:
    """Peak activation bytes of one training pass of the recipe's micro-batches on one GPU of `stage`, on
    sequences of `seq_len` tokens; the logprob head's unless `value_head` (a critic's scalar head). With
    `train.micro_batch_tokens` a micro-batch is one packed row of `packed_tokens` tokens (default: that many, or
    an RL step's whole share of a data-parallel rank, padded to `seq_len`, when it is smaller)."""
    logits = LOGITS_BYTES + (ENTROPY_BYTES if cfg.algo.entropy_coef > 0 else 0)
    vocab_slice = padded_vocab_size(shape.vocab_size, tp=layout.tp) // layout.tp
    micro_batch_size = cfg.train.micro_batch_size
    if cfg.train.micro_batch_tokens:
        if packed_tokens is None:
            packed_tokens = cfg.train.micro_batch_tokens
            if not cfg.algo.traits.offline:
                share = cfg.data.prompts_per_step * cfg.rollout.n_samples // layout.dp * seq_len
                packed_tokens = min(packed_tokens, share)
        seq_len, micro_batch_size = packed_tokens, 1
    return activation_bytes(shape, layout, stage=stage, seq_len=seq_len, megatron=cfg.model.megatron,
                            micro_batch_size=micro_batch_size, act_bytes=DTYPE_BYTES[cfg.model.dtype],
                            head_bytes_per_token=0 if value_head else logits * vocab_slice)


def trained_tokens(cfg: Config, layout: Layout, *, prompt_tokens: int, seq_len: int) -> str:
    """The tokens each data-parallel rank trains per step at full length: n * (P + R) per prompt, or with
    train.share_prompts P + n * R (the prompt once per group, megarl.packing.shared_row)."""
    n, prompts = cfg.rollout.n_samples, cfg.data.prompts_per_step
    response = seq_len - prompt_tokens
    unshared = prompts * n * seq_len // layout.dp
    if not cfg.train.share_prompts:
        return (f"trained tokens per step and data-parallel rank: {unshared} (data.prompts_per_step x "
                f"rollout.n_samples x {seq_len} / dp)")
    shared = prompts * (prompt_tokens + n * response) // layout.dp
    return (f"trained tokens per step and data-parallel rank: {shared} with train.share_prompts (each prompt "
            f"once: data.prompts_per_step x ({prompt_tokens} + rollout.n_samples x {response}) / dp), "
            f"{unshared / shared:.2f}x fewer than {unshared}")


def assumptions(cfg: Config, layout: Layout, *, seq_source: str, experts: bool,
                routing: Routing | None = None) -> list[str]:
    megatron = cfg.model.megatron
    recompute = megatron.get("recompute_granularity") or "none"
    if recompute == "full":
        recompute += f" ({megatron.get('recompute_method')}, units of {megatron.get('recompute_num_layers')} layer(s))"
    offline, split = cfg.algo.traits.offline, layout.rollout_ranks > 0
    kept = ", but the optimizer's share optim.cpu_offload keeps there" if cfg.optim.cpu_offload else ""
    if offline:
        phases = (f"{cfg.algo.name} has no rollout engine: one phase, train, with every model resident"
                  + (" (the frozen reference beside the actor)" if cfg.algo.traits.reference else ""))
        host = f"host: nothing offloaded{kept}; {HOST_RESERVE_GIB:g} GiB per GPU for the processes"
    elif split:
        phases = (f"placement split, nothing offloaded: training GPUs ({rank_range(0, layout.world)}) hold every "
                  "trainer model all the time and no rollout engine: train (all trainer models resident), push "
                  "(training rank 0: the same state + one bucket + 2 copies of the largest tensor, broadcast to the "
                  f"engines); rollout GPUs ({rank_range(layout.world, layout.world + layout.rollout_ranks)}) hold the "
                  "engine alone: rollout (its static memory), push (+ the one bucket it receives)")
        host = (f"host, per node: nothing offloaded (placement split){kept}; {HOST_RESERVE_GIB:g} GiB per GPU for "
                f"the processes; usable = {HOST_USABLE_FRACTION:.0%} of --host-mem-gb")
    else:
        phases = ("phases as the RL loop orders them: train (all trainer models resident"
                  + (", beside the engine's base weights, which rollout.lora_sync: adapter keeps" if
                     cfg.rollout.lora_sync == "adapter" else "; the engines' weights and KV cache released")
                  + "), push (trainer parameters + rollout weights + one bucket + 2 copies of the largest tensor), "
                  "rollout (trainer offloaded); a rollout engine on every GPU")
        host = ("host, per node: every trainer model's parameters pinned, the trained models' optimizer state"
                + (" (the share optim.cpu_offload keeps there in every phase included)" if cfg.optim.cpu_offload
                   else "") + ", "
                + ("one parameter buffer's pageable copy on the first offload, " if cfg.optim.distributed else "")
                + f"{HOST_RESERVE_GIB:g} GiB per GPU for the processes; usable = {HOST_USABLE_FRACTION:.0%} of "
                "--host-mem-gb")
    out = [
        f"sequences padded to {seq_source}",
        f"parameters in model.dtype {cfg.model.dtype}; gradients fp32; Adam moments fp32"
        + ("" if cfg.model.dtype == "float32" else " plus an fp32 master copy")
        + (f", sharded over dp*cp = {layout.dp * layout.cp}" + (f" (experts: {layout.expert_dp})" if experts else "")
           if cfg.optim.distributed else ", not sharded (optim.distributed: false)")
        + (f"; optim.cpu_offload {cfg.optim.cpu_offload:g}: that share of its elements (whole tensors, at least "
           "that share) on the host in every phase, stepped there, with a host copy of their gradients "
           f"({OFFLOAD_GRAD_BYTES} bytes per element)" if cfg.optim.cpu_offload else ""),
        f"activations: Korthikanti et al. 2022 generalized to GQA/SwiGLU/experts; recompute {recompute}; "
        f"sequence_parallel {bool(megatron.get('sequence_parallel'))}; fused attention (no seq^2 term); "
        "balanced expert routing",
        f"logprob head: {LOGITS_BYTES} bytes per token and vocabulary entry of the TP slice"
        + ("" if offline else f" (+{ENTROPY_BYTES} with an entropy bonus)"),
        phases,
    ]
    if cfg.teacher.path is not None:
        out.append("distillation teacher: frozen (parameters only), at the trainer's layout, woken and parked with the "
                   "reference (offloaded to the host while the engines generate); a checkpoint not on this machine "
                   "is planned with the policy's architecture")
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


def gib(nbytes: float) -> str:
    """`nbytes` in GiB, as the plan's table and reasons print it."""
    return f"{nbytes / GIB:.1f}"


def rank_range(start: int, stop: int) -> str:
    """Ranks `start` ... `stop - 1`, as the plan's table and assumptions name them."""
    return f"rank {start}" if stop - start == 1 else f"ranks {start}-{stop - 1}"

