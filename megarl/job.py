"""What a run is, resolved once: `Job.of(cfg, world=..., ranks_per_node=...)`.

A recipe says what to train; the Job says what that means on this job: the shape of every checkpoint the run
reads, the parallel layout (megarl.layout), the cast of models (each role's checkpoint, shape, optimizer, head,
adapters, and whether it is the actor itself), the layer spec (Transformer Engine's or Megatron's local one) and
the Megatron settings the engines take. Launch resolves it before anything is built (megarl.loops.launch) and
every loop, the engine builder (megarl.engine.roles) and `megarl plan` read it; nothing after re-reads a
checkpoint's config or re-derives which models a run has. The recipe checks that depend on the model, the world
or the install are here and raise RecipeError naming the keys (the engine calls the same functions as guards);
checks the recipe alone decides stay in megarl.config. The recipe the user wrote is never changed: what launch
resolves goes to `run_dir/job.yaml` beside it.

    job = Job.of(cfg, world=8, ranks_per_node=8)      # launch; planning=True for `megarl plan`
    for role in job.cast: ...                        # the models a run's steps hold, in build order
    actor = build_engine(job, job.role("actor"), groups)   # megarl.engine.roles

This module imports no torch, Megatron or SGLang: `megarl plan` resolves a run on any machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megarl.config import Config, LoraConfig, OptimConfig, RecipeError
from megarl.layout import Layout, virtual_stage_count
from megarl.models.arch import ModelShape, read_shape

MLP_TARGETS = ("fc1", "fc2")  # model.lora.targets that wrap the MLP: a MoE model's experts and shared experts

# actor: the trained policy; reference: frozen policy for the KL (or DPO's); critic: PPO's value model (scalar
# head, its own learning rate); reward_model: a scalar-head model, frozen where it scores an RL run's samples and
# trained by the reward-model loop; teacher: the frozen model of on-policy distillation (its own checkpoint);
# warmup: the policy of RL's supervised warm start (its own learning rate, no learning-rate warmup).
RoleName = Literal["actor", "reference", "critic", "reward_model", "teacher", "warmup"]


@dataclass(frozen=True)
class ModelRole:
    """One model of a run, resolved: what megarl.engine.roles builds (or, `shares_actor`, reads of the actor)."""

    name: RoleName
    key: str                  # the recipe key of its checkpoint, for messages: model.path, reward.terms[0].path, ...
    checkpoint: str           # the HF checkpoint directory it starts from
    shape: ModelShape
    optim: OptimConfig | None = None  # None: frozen (no gradients, no optimizer state)
    value_head: bool = False  # a scalar head instead of the vocabulary projection
    lora: LoraConfig | None = None  # adapters on its linears (the actor of a LoRA run)
    shares_actor: bool = False  # the reference of a LoRA run: the actor with its adapters off, no model of its own

    @property
    def trainable(self) -> bool:
        return self.optim is not None


def model_shape(path: str | Path, *, key: str | None = None) -> ModelShape:
    """The architecture of the HF checkpoint at `path` (its config.json); RecipeError (naming the recipe `key`,
    when given, and the file) when it is not one megarl supports or cannot be read."""
    try:
        shape = read_shape(path)
    except ValueError as e:
        raise RecipeError(f"{key}: {e}" if key else str(e)) from None
    refuse_vision(shape, key=key, where=str(path))
    return shape


def refuse_vision(shape: ModelShape, *, key: str | None, where: str) -> None:
    """RecipeError for a vision-language checkpoint: megarl reads their shape (megarl.models.arch.VisionShape) but
    builds, generates and trains text models only."""
    if shape.vision is not None:
        raise RecipeError(f"{key + ': ' if key else ''}{where} is a vision-language model ({shape.arch}): "
                          "vision-language training is not available yet; point it at a text-only checkpoint")


@dataclass(frozen=True)
class Job:
    """One run, resolved (see the module docstring)."""

    cfg: Config
    shape: ModelShape              # the policy's (model.path)
    layout: Layout
    cast: tuple[ModelRole, ...]    # every model the run's steps hold, in the order the loop builds them
    warm_start: ModelRole | None   # RL's supervised warm start: trained, exported and freed before the cast is built
    te_layers: bool                # Transformer Engine's layer spec for every model (else Megatron's local one)
    megatron: dict                 # the TransformerConfig fields the engines take: model.megatron and what launch set

    @classmethod
    def of(cls, cfg: Config, *, world: int, ranks_per_node: int, shape: ModelShape | None = None,
           planning: bool = False, transformer_engine: bool = False) -> Job:
        """The run of recipe `cfg` on a job of `world` ranks, `ranks_per_node` to a node. `shape`: the policy's
        architecture when it is not read from model.path (`megarl plan --model-config`). `planning`: the
        cluster's checkpoints need not be on this machine (a model whose config.json is missing is planned with
        the policy's architecture) and the checks of the install wait for launch. `transformer_engine`:
        Transformer Engine's layers are usable here (launch asks megarl.engine.model.uses_transformer_engine).
        RecipeError (LayoutError for the layout) names the keys."""
        shape = shape or model_shape(cfg.model.path, key="model.path")
        refuse_vision(shape, key="model.path", where=str(cfg.model.path))

        def shape_of(path: str | None, key: str) -> ModelShape:
            if path is None or planning and not (Path(path) / "config.json").is_file():
                return shape
            return model_shape(path, key=key)

        teacher = shape_of(cfg.teacher.path, "teacher.path") if cfg.teacher.path is not None else None
        layout = Layout.of(cfg, shape, world=world, ranks_per_node=ranks_per_node, teacher=teacher)
        megatron = dict(cfg.model.megatron)
        if cfg.train.share_prompts:
            # a shared row is rotated by its position ids, own tokens continuing after their prompt, where the
            # fused kernel restarts them at every segment
            megatron.setdefault("apply_rope_fusion", False)
        cast, warm_start = cast_of(cfg, shape, shape_of=shape_of)
        job = cls(cfg=cfg, shape=shape, layout=layout, cast=cast, warm_start=warm_start,
                  te_layers=transformer_engine and cfg.model.lora is None, megatron=megatron)
        job.check(install=not planning)
        return job

    # ---- the checks that depend on the model, the world or the install ----------------------------------
    def check(self, *, install: bool) -> None:
        """RecipeError, naming the keys, for a run these models and this layout cannot train, and (`install`) one
        this machine's Megatron cannot build."""
        cfg, shape, megatron = self.cfg, self.shape, self.megatron
        if cfg.train.share_prompts and cfg.model.megatron.get("apply_rope_fusion"):
            raise RecipeError("model.megatron.apply_rope_fusion: true cannot be combined with train.share_prompts "
                              "(the fused RoPE kernel restarts positions at every segment of a packed row, where a "
                              "shared row's own tokens continue after their prompt)")
        comm = megatron.get("cp_comm_type")
        if cfg.parallel.cp > 1 and (comm == "a2a+p2p" or isinstance(comm, list) and "a2a+p2p" in comm):
            # the hierarchical exchange needs hierarchical_context_parallel_sizes at parallel-state init
            raise RecipeError("model.megatron.cp_comm_type = 'a2a+p2p' (hierarchical context parallelism) is not "
                              "supported; use 'p2p', 'all_gather' or 'a2a'")
        if not cfg.algo.traits.offline:
            if cfg.algo.router_replay != "none" and not shape.is_moe:
                raise RecipeError(f"algo.router_replay = {cfg.algo.router_replay!r} replays mixture-of-experts "
                                  f"routing; the model in model.path ({shape.arch}) has no experts: set it to 'none'")
            if cfg.rollout.lora_sync == "adapter" and adapts_experts(cfg.model.lora, shape):
                raise RecipeError(f"rollout.lora_sync = 'adapter' with model.lora.targets {cfg.model.lora.targets} "
                                  f"on a mixture-of-experts model ({shape.arch}): adapters on experts go to the "
                                  "rollout engines merged into their weights only (rollout.lora_sync: merged, or "
                                  "target qkv and proj)")
            if cfg.algo.router_replay != "none" and megatron.get("moe_router_fusion"):
                raise RecipeError("algo.router_replay needs Megatron's unfused router: the fused top-k kernel "
                                  "(model.megatron.moe_router_fusion: true) has no replay hook")
        if shape.linear_bias and shape.is_moe and self.layout.etp > 1:
            size = (f"parallel.etp = {cfg.parallel.etp}" if cfg.parallel.etp is not None else
                    f"parallel.tp = {cfg.parallel.tp} (parallel.etp unset: the experts split over the TP ranks)")
            raise RecipeError(f"{size} with a {shape.arch} model: Megatron takes biased experts at expert "
                              "tensor-parallel size 1 only; set parallel.etp: 1 (each expert whole on its rank) "
                              "and spread the experts with parallel.ep")
        if shape.mla and (cfg.train.share_prompts or cfg.parallel.cp > 1):
            key = "train.share_prompts" if cfg.train.share_prompts else f"parallel.cp = {cfg.parallel.cp}"
            raise RecipeError(f"{key} with multi-latent attention ({shape.arch}): its attention rotates queries and keys "
                              "itself, from each segment's start, which shared-prompt rows and context-parallel "
                              "chunks do not keep; turn it off")
        if cfg.train.share_prompts and any(shape.window_layers):
            raise RecipeError(f"train.share_prompts with a model whose local layers attend over a sliding window "
                              f"({shape.arch}): a shared row puts a sample's tokens at other distances from its "
                              "prompt than the sample alone has; turn train.share_prompts off")
        if cfg.train.share_prompts and shape.is_moe:
            refusal = shared_prompt_moe_refusal((moe_settings(shape, te_layers=self.te_layers) | megatron).get)
            if refusal:
                raise RecipeError(f"train.share_prompts on a mixture-of-experts model ({shape.arch}): {refusal}")
        if cfg.model.lora is not None:
            check_lora(cfg.model.lora, shape, te=self.te_layers, etp=self.layout.etp)
        if install:  # the fields of the installed Megatron's TransformerConfig
            check_megatron_fields(megatron)

    # ---- the cast --------------------------------------------------------------------------------------------
    def role(self, name: str) -> ModelRole | None:
        """The cast's model `name` (the first, for reward models), or None when the run has none."""
        return next((role for role in self.cast if role.name == name), None)

    def roles(self, name: str) -> list[ModelRole]:
        """Every model of the cast named `name` (a run's reward models), in order."""
        return [role for role in self.cast if role.name == name]

    def from_warm_start(self, model_dir: str) -> Job:
        """This run once its supervised warm start has exported the policy to `model_dir`: every role that starts
        from model.path starts from there (the same architecture)."""
        policy = self.cfg.model.path
        cast = tuple(dataclasses.replace(role, checkpoint=model_dir) if role.checkpoint == policy else role
                     for role in self.cast)
        return dataclasses.replace(self, cast=cast)

    def resolved(self) -> dict:
        """What launch resolved, as `run_dir/job.yaml` records it beside the recipe (plain YAML types)."""
        layout = dataclasses.asdict(self.layout)
        return {
            "layout": layout,
            "layer_spec": "transformer_engine" if self.te_layers else "local",
            "megatron": dict(self.megatron),
            "models": [{"name": role.name, "key": role.key, "checkpoint": role.checkpoint, "arch": role.shape.arch,
                        "trainable": role.trainable, "value_head": role.value_head, "adapters": role.lora is not None,
                        "shares_actor": role.shares_actor} for role in self.cast],
            # the warm start trains from `from` and exports to `to`; the models above that start from model.path
            # then start from that export (`from_warm_start`)
            "warm_start": None if self.warm_start is None else {"from": self.warm_start.checkpoint,
                                                                "to": str(warm_start_dir(self.cfg))},
        }


def warm_start_dir(cfg: Config) -> Path:
    """Where RL's supervised warm start exports the policy the run then starts from."""
    return Path(cfg.run_dir) / "warmup"


def cast_of(cfg: Config, shape: ModelShape, *, shape_of) -> tuple[tuple[ModelRole, ...], ModelRole | None]:
    """The models of recipe `cfg`'s run, in the order its loop builds them, and RL's warm-start model.

    RL: the actor; the reference when algo.kl_coef > 0 (with model.lora the actor with its adapters off); the
    distillation teacher; PPO's critic; the reward models of reward.terms. SFT: the actor. DPO: the actor and
    its reference. RM: the scalar-head model it trains. `shape_of(path, key)` reads a checkpoint's shape."""
    policy, traits = cfg.model.path, cfg.algo.traits
    if traits.scalar_head:  # the reward-model loop: the one model it trains
        return (ModelRole("reward_model", "model.path", policy, shape, optim=cfg.optim, value_head=True),), None
    cast = [ModelRole("actor", "model.path", policy, shape, optim=cfg.optim, lora=cfg.model.lora)]
    # an offline loop builds what its algorithm needs; the RL loop also a reference for the KL, and a teacher
    if traits.reference or not traits.offline and cfg.algo.kl_coef > 0:
        cast.append(ModelRole("reference", "model.path", policy, shape, shares_actor=cfg.model.lora is not None))
    if traits.offline:
        return tuple(cast), None
    if cfg.teacher.path is not None:
        cast.append(ModelRole("teacher", "teacher.path", cfg.teacher.path, shape_of(cfg.teacher.path, "teacher.path")))
    if traits.critic:
        path, key = (cfg.critic.path, "critic.path") if cfg.critic.path else (policy, "model.path")
        cast.append(ModelRole("critic", key, path, shape_of(path, key) if cfg.critic.path else shape,
                              optim=dataclasses.replace(cfg.optim, lr=cfg.critic.lr), value_head=True))
    for i, term in enumerate(cfg.reward.terms):
        if term.kind == "reward_model":
            key = f"reward.terms[{i}].path"
            cast.append(ModelRole("reward_model", key, term.path, shape_of(term.path, key), value_head=True))
    warm_start = None
    if cfg.warmup.sft_steps:
        warm_start = ModelRole("warmup", "model.path", policy, shape,
                               optim=dataclasses.replace(cfg.optim, lr=cfg.warmup.lr, warmup_steps=0))
    return tuple(cast), warm_start


def check_same_tokenizer(model_path: str, teacher_path: str) -> None:
    """The teacher scores the student's token ids: both checkpoints must map every token to the same id and
    agree on the special tokens; RecipeError names teacher.path and the first difference."""
    from transformers import AutoTokenizer

    student, teacher = AutoTokenizer.from_pretrained(model_path), AutoTokenizer.from_pretrained(teacher_path)
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    differs = None
    if len(ours) != len(theirs):
        differs = f"a vocabulary of {len(theirs)} tokens, the student's {len(ours)}"
    elif ours != theirs:
        token = min(t for t in ours if ours[t] != theirs.get(t))
        differs = (f"token {token!r} is id {theirs[token]}, the student's {ours[token]}" if token in theirs
                   else f"token {token!r} (the student's id {ours[token]}) is not in its vocabulary")
    else:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(student, name) != getattr(teacher, name):
                differs = f"{name} {getattr(teacher, name)}, the student's {getattr(student, name)}"
                break
    if differs:
        raise RecipeError(f"teacher.path: the teacher's tokenizer ({teacher_path}) is not the student's (model.path: "
                          f"{model_path}): {differs}; distillation scores the student's token ids with the teacher")


# ---- the rules of megarl's engine, read as recipe checks ------------------------------------------------
def moe_settings(shape: ModelShape, *, te_layers: bool) -> dict:
    """TransformerConfig MoE fields that route exactly as transformers does (megarl.models.arch).

    Megatron's default router takes the top-k logits and softmaxes over those k: the renormalized top-k
    probabilities of `norm_topk`. Without renormalization, `moe_router_pre_softmax` softmaxes over all
    experts before the top-k. Dropless (no capacity factor): every token reaches its k experts, as in HF.

    Sigmoid routing (GLM-4.5, DeepSeek-V3) chooses by the scores plus the expert bias, grouped, and weighs by
    the renormalized scores times the routed scale, in float32 as transformers does. The bias is the
    checkpoint's `e_score_correction_bias`; its update rate is 0, as in the RL recipes of the frameworks that
    train these models: a policy update must not move the routing that rollouts were sampled with (and routing
    replay reproduces), and the bias is a buffer the policy loss has no gradient for. A recipe may set
    model.megatron.moe_router_bias_update_rate to keep balancing the load as pretraining did.
    """
    sigmoid = shape.moe_score == "sigmoid"
    routing = dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=shape.expert_bias,
        moe_router_bias_update_rate=0.0, moe_router_topk_scaling_factor=shape.routed_scale,
        moe_router_num_groups=shape.moe_groups or None, moe_router_group_topk=shape.moe_group_topk or None,
        moe_router_dtype="fp32",
    ) if sigmoid else dict(moe_router_pre_softmax=not shape.norm_topk, moe_router_score_function="softmax")
    return dict(
        num_moe_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.moe_ffn, **routing,
        moe_layer_freq=[0 if layer < shape.dense_layers else 1 for layer in range(shape.layers)],
        moe_shared_expert_intermediate_size=shape.shared_ffn or None, moe_shared_expert_gate=shape.shared_gate,
        # Switch-Transformer load balancing per micro-batch, summed over layers; HF adds it only when
        # `output_router_logits` and over all layers' tokens at once (and with top-k times Megatron's scale),
        # so the coefficient means the same strength only roughly. A recipe can override it (model.megatron).
        moe_router_load_balancing_type="aux_loss" if shape.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=shape.aux_loss_coeff, moe_expert_capacity_factor=None,
        # Grouped GEMM needs the CUDA-only grouped_gemm / Transformer Engine kernels.
        moe_grouped_gemm=te_layers,
    )


def shared_prompt_moe_refusal(setting: Callable[[str], object]) -> str | None:
    """Why a MoE model would not train a shared-prompt row (train.share_prompts) as its samples alone; None where
    it would. `setting(name)` is the model's TransformerConfig field `name` (None when unset): the built config's,
    or at launch moe_settings with the recipe's model.megatron over them. Megatron's routers count the tokens of
    their micro-batch, and a shared row holds a prompt's tokens once instead of once per sample: what counts
    tokens changes, what routes each token alone does not."""
    def on(name: str) -> bool:
        value = setting(name)
        return any(v for v in value) if isinstance(value, (list, tuple)) else bool(value)

    if not setting("num_moe_experts"):
        return None
    if on("moe_aux_loss_coeff") and (setting("moe_router_load_balancing_type") or "aux_loss") != "none":
        return (f"the load-balancing loss (moe_aux_loss_coeff = {setting('moe_aux_loss_coeff')}) would count a "
                "shared prompt's tokens once instead of once per sample; set model.megatron.moe_aux_loss_coeff: 0")
    if on("moe_z_loss_coeff"):
        return (f"the router z-loss (moe_z_loss_coeff = {setting('moe_z_loss_coeff')}) would count a shared "
                "prompt's tokens once instead of once per sample; leave model.megatron.moe_z_loss_coeff unset")
    if setting("moe_expert_capacity_factor") is not None:
        return ("expert capacity (moe_expert_capacity_factor) drops tokens by how many reach an expert, which "
                "holding a prompt once changes")
    rate = setting("moe_router_bias_update_rate")  # Megatron's default: 1e-3
    if on("moe_router_enable_expert_bias") and (rate is None or rate != 0):
        return ("the expert bias (moe_router_enable_expert_bias) follows how many tokens reach each expert, which "
                "holding a prompt once changes")
    return None


# Megatron settings the engine cannot honour, refused when set to anything but Megatron's default.
_CUDA_GRAPHS = ("CUDA graphs replay the device addresses and shapes they captured, but every step's micro-batches "
                "have shapes of their own, and the co-located trainer offloads its parameters, gradients and "
                "optimizer state between steps and brings them back at new addresses (megarl.engine.offload)")
_QUANTIZED_PARAMS = ("fp8/fp4 parameters are held as Transformer Engine's quantized tensors, which the HF checkpoint "
                     "load, the weight push to the rollout engine and the HF export do not read or write")


def _unsupported(name: str) -> str | None:
    """Why the engine cannot honour TransformerConfig field `name` (None: it can)."""
    if "cuda_graph" in name:  # enable_cuda_graph, external_cuda_graph, cuda_graph_impl, cuda_graph_scope, ...
        return _CUDA_GRAPHS
    if name in ("fp8_param", "fp4_param"):
        return _QUANTIZED_PARAMS
    return None


def check_megatron_fields(megatron: dict) -> None:
    """The recipe's `model.megatron` keys must be TransformerConfig fields the engine can honour; RecipeError
    names the key."""
    from megatron.core.transformer import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(megatron) - set(fields))
    if unknown:
        raise RecipeError(f"model.megatron: unknown TransformerConfig field(s): {', '.join(unknown)}")
    for name, value in megatron.items():
        reason = _unsupported(name)
        if reason is not None and value != fields[name].default:
            raise RecipeError(f"model.megatron.{name} = {value!r} is not supported: {reason}")
    virtual_stage_count(megatron)  # a whole number >= 1 (megarl.layout)


def check_lora(lora: LoraConfig, shape: ModelShape, *, te: bool, value_head: bool = False, etp: int = 1) -> None:
    """RecipeError, naming the key and the reason, for adapters megarl's engine cannot build (`te`: on Transformer
    Engine's layers; `etp`: the expert tensor-parallel size, over which the experts' linears are split)."""
    if value_head:
        raise RecipeError("model.lora adapts the policy only: a critic or reward model (scalar head) trains or "
                          "scores with all of its weights")
    if te:
        raise RecipeError("model.lora wraps Megatron's local linear layers (ColumnParallelLinear, RowParallelLinear); "
                          "Transformer Engine's fused layers (norm and linear in one module) have no adapter here; "
                          "a LoRA run's models are built on the local layers (Job.of resolves it)")
    attention = [t for t in lora.targets if t not in MLP_TARGETS]
    if shape.mla and attention:
        raise RecipeError(f"model.lora.targets = {lora.targets}: multi-latent attention ({shape.arch}) has no fused "
                          f"qkv projection, and its down- and up-projections take no adapters here; target fc1 and fc2")
    if shape.linear_bias and adapts_experts(lora, shape):
        raise RecipeError(f"model.lora.targets = {lora.targets}: {shape.arch}'s experts are stacked in one HF tensor "
                          "per layer, which adapters are not exported for; target qkv and proj")
    if adapts_experts(lora, shape) and etp > 1:
        mlp = [t for t in lora.targets if t in MLP_TARGETS]
        raise RecipeError(f"model.lora.targets = {lora.targets}: the experts' linears ({', '.join(mlp)}) of a "
                          f"mixture-of-experts model ({shape.arch}) take adapters at expert tensor parallelism 1 only "
                          f"(here {etp}: Megatron's dispatcher, not the layer, sums their tensor-parallel "
                          "parts); set parallel.etp: 1 and spread the experts with parallel.ep, or target qkv and proj")


def adapts_experts(lora: LoraConfig | None, shape: ModelShape) -> bool:
    """Whether `lora` puts adapters on a MoE model's experts (and shared experts): targets fc1 or fc2."""
    return lora is not None and shape.is_moe and any(t in MLP_TARGETS for t in lora.targets)


def check_virtual_pipeline_p2p(*, batch_p2p_comm: bool, pp: int) -> None:
    """With virtual pipeline stages and pp = 2, a rank's previous and next stage are the same peer; batched
    into one batch_isend_irecv, gloo pairs the messages each way by posting order, so activations land in
    gradient buffers (measured: wrong losses, no error). NCCL matches them correctly."""
    if pp == 2 and batch_p2p_comm:
        raise RecipeError("model.megatron.batch_p2p_comm: true with virtual pipeline stages and parallel.pp = 2 "
                          "mixes up activations and gradients on gloo (both go to the same peer); leave it unset")
