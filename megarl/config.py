"""Recipe configuration: the tree of small frozen dataclasses a YAML recipe maps onto one-to-one, each section
with its checks.

    cfg = load_config("recipes/grpo_tiny.yaml", ["rollout.temperature=0.7", "optim.lr=1e-5"])
    dump_config(cfg, Path(cfg.run_dir) / "recipe.yaml")   # loading it back gives an equal Config

The loader (megarl.dataclass_yaml) is generic over the tree: a field's annotation is its type check, an
unknown key is a ConfigError naming the file and the dotted key, and a section's `check(self)` raises
FieldError(field, message) for one bad field or ValueError(message) for a relation between fields.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megarl.algo.traits import ALGOS, AlgoName, AlgoTraits
from megarl.dataclass_yaml import FieldError, load_dataclass

Dtype = Literal["float32", "bfloat16", "float16"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PROMPT_FILE_SUFFIXES = (".jsonl", ".parquet")


class RecipeError(ValueError):
    """A recipe value that cannot work with this launch or model (world size, model architecture), found
    when the run starts but before any work. The message names the keys; the CLI adds the file."""


def _at_least(section: Any, minimum: int | float, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value >= minimum:  # written so that NaN fails too
            raise FieldError(name, f"must be >= {minimum}, got {value}")


def _positive(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value > 0:
            raise FieldError(name, f"must be > 0, got {value}")


# ---------------------------------------------------------------------------------------------- schema


LoraTarget = Literal["qkv", "proj", "fc1", "fc2"]
# The HF projections each target kind adapts (the modules of the adapters' PEFT names, SGLang's
# lora_target_modules): a fused Megatron linear is several HF ones
LORA_HF_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "proj": ("o_proj",), "fc1": ("gate_proj", "up_proj"),
                   "fc2": ("down_proj",)}


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the policy's linear layers (Hu et al. 2021): each wrapped W [out, in] computes
    W x + (alpha / rank) B A dropout(x), A [rank, in], B [out, rank] zero at the start, and only A and B train
    (megarl.engine.lora)."""

    rank: int = 8  # r, the adapters' inner dimension
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input, in [0, 1)
    # module kinds wrapped in every layer: qkv (fused query/key/value), proj (attention output), fc1 (MLP
    # gate and up, fused), fc2 (MLP down)
    targets: list[LoraTarget] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])

    def hf_modules(self) -> list[str]:
        """The HF module names the targets adapt, in LORA_HF_MODULES order."""
        return [module for kind, modules in LORA_HF_MODULES.items() if kind in self.targets for module in modules]

    def check(self) -> None:
        _at_least(self, 1, "rank")
        _positive(self, "alpha")
        if not 0 <= self.dropout < 1:
            raise FieldError("dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise FieldError("targets", "must name at least one module kind (qkv, proj, fc1, fc2)")
        if len(set(self.targets)) != len(self.targets):
            raise FieldError("targets", f"names a module kind twice: {self.targets}")


# TransformerConfig's parallel sizes, which the recipe's `parallel:` section sets: Megatron's parallel state is
# made from that section, and a config field of its own would disagree with it
LAYOUT_FIELDS = {"tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
                 "expert_model_parallel_size": "parallel.ep", "expert_tensor_parallel_size": "parallel.etp",
                 "context_parallel_size": "parallel.cp"}


@dataclass(frozen=True)
class ModelConfig:
    path: str = field(metadata={"path": "dir"})  # local HuggingFace checkpoint directory
    dtype: Dtype = "float32"  # parameter and compute dtype of trainer and rollout engine
    # extra TransformerConfig fields, checked by the engine; the parallel sizes are the parallel section's
    megatron: dict[str, Any] = field(default_factory=dict)
    # train low-rank adapters of the policy instead of its weights (frozen); the reference policy is then the
    # policy with its adapters off. null: full training
    lora: LoraConfig | None = None

    def check(self) -> None:
        for name, key in LAYOUT_FIELDS.items():
            if name in self.megatron:
                raise FieldError("megatron", f"{name} is the parallel layout's: set {key} instead")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    ep: int = 1  # expert-parallel size (MoE models)
    # Expert tensor-parallel size (MoE models): the ranks each routed expert's linears are split over, Megatron's
    # expert_tensor_parallel_size. 1 keeps every expert whole on its rank while attention splits over parallel.tp,
    # the experts spread over parallel.ep instead (how large MoE models are usually trained; biased experts,
    # gpt-oss's, take only 1). null: parallel.tp, Megatron's default
    etp: int | None = None
    cp: int = 1  # context-parallel size
    # How long a rank waits in a collective before the job fails, for every process group (NCCL and gloo):
    # ranks wait through a whole generation phase and a cold start of large models, so far above the
    # 10-minute default of NCCL.
    timeout_minutes: float = 60.0

    def check(self) -> None:
        _at_least(self, 1, "tp", "pp", "ep", "cp")
        if self.etp is not None:
            _at_least(self, 1, "etp")
        _positive(self, "timeout_minutes")


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["native", "sglang"] = "native"  # generation backend
    n_samples: int = 4  # samples per prompt (group size)
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]
    max_new_tokens: int = 64  # generation length limit per sample
    # weight handoff bucket size: 512 MiB, as a GPU run wants it (each bucket costs an SGLang call and a TP
    # barrier; the plan counts one bucket in the push phase). A model smaller than that goes in one bucket.
    bucket_bytes: int = 512 * 2**20
    tp: int = 1  # ranks per engine (SGLang's TP size): one engine on every group of this many ranks
    mem_fraction: float = 0.5  # SGLang's static memory fraction (weights + KV cache): of the GPU, on CPU of free RAM
    # After a weight push, compare the engine's copy of the pushed tensors with the trainer's (megarl.handoff).
    # first: every tensor at a run's first push only; sampled: every tensor at the first push, then a rotating
    # 1 / verify_period of them at each push; every: every tensor at every push; off: none
    verify_weights: Literal["first", "sampled", "every", "off"] = "sampled"
    verify_period: int = 4  # sampled: every tensor is verified again within this many pushes
    # Stop the run when the mean |rollout - trainer| logprob per generated token (rollout/logprob_diff_mean)
    # stays above this for drift_patience steps in a row; null: never. Honest quickstart runs measured at most
    # 3.7e-7 (fp32) and 8e-3 (bf16), an engine left on old weights 0.26 after three updates and up to 3.9:
    # docs/rollouts.md, "Weight hand-off and engine faults"
    max_logprob_drift: float | None = 0.25
    drift_patience: int = 3  # steps in a row above max_logprob_drift that stop the run (fewer: a warning)
    # The longest an engine call may go without progress before it fails, naming its phase: one bucket of a
    # push, a flush, release or resume, or a generate call in which no response finished (SGLang; the native
    # engine computes in the trainer's own process). Above the longest response's decode time: 32k tokens at
    # 20 tokens/s take 27 minutes
    engine_timeout_s: float = 1800.0
    # A rollout engine that dies or fails a call is started again, given the current weights, and what it had
    # not returned is generated again, up to this many times per run (all engines together); one more failure
    # stops the run with a checkpoint of its last step (colocated placement)
    max_engine_restarts: int = 3
    # What a LoRA policy (model.lora) hands the engines after each update. merged: the merged weights
    # W + (alpha / rank) B A, every tensor of the model; adapter: the adapters alone (a few MiB where the model is
    # GiB), which the engine applies over the base weights it started from (SGLang's LoRA serving; the native
    # engine merges them itself). Colocated placement
    lora_sync: Literal["merged", "adapter"] = "merged"

    def check(self) -> None:
        _at_least(self, 1, "n_samples", "max_new_tokens", "tp", "verify_period", "drift_patience")
        _at_least(self, 0, "max_engine_restarts")
        _positive(self, "temperature", "bucket_bytes", "engine_timeout_s")
        if self.max_logprob_drift is not None:
            _positive(self, "max_logprob_drift")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 < self.mem_fraction < 1:
            raise FieldError("mem_fraction", f"must be in (0, 1), got {self.mem_fraction}")


@dataclass(frozen=True)
class PlacementConfig:
    """Where generation runs. colocated: on every rank, taking turns with training (synchronous). split: on
    the last `rollout_ranks` ranks of the job, which generate while the others train (asynchronous RL,
    bounded by algo.max_staleness); weights reach them through a collective broadcast."""

    mode: Literal["colocated", "split"] = "colocated"
    rollout_ranks: int = 0  # split: ranks that only generate (a multiple of rollout.tp); colocated: 0
    # split: generate in chunks of chunk_tokens and take weights pushed meanwhile between chunks, so a response
    # started under older weights continues under the newer ones (each token keeps its version and logprob)
    partial_rollouts: bool = False
    chunk_tokens: int = 16

    def check(self) -> None:
        _at_least(self, 0, "rollout_ranks")
        _at_least(self, 1, "chunk_tokens")
        if self.partial_rollouts and self.mode != "split":
            raise FieldError("partial_rollouts", "interrupts generations at weight pushes, which only "
                                                 "placement.mode = 'split' has")
        if self.mode == "split" and self.rollout_ranks < 1:
            raise FieldError("rollout_ranks", "placement.mode = 'split' needs at least one rollout rank")
        if self.mode == "colocated" and self.rollout_ranks:
            raise FieldError("rollout_ranks", f"is {self.rollout_ranks}, but placement.mode = 'colocated' "
                                              "generates on every rank; set placement.mode: split")


@dataclass(frozen=True)
class AlgoConfig:
    """The algorithm: `name` chooses the advantage estimator and the policy loss; the other keys are the
    knobs of the papers, each off by default unless the algorithm is defined by it."""

    name: AlgoName = "grpo"  # ppo (GAE + critic), grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp(_baseline), distill
    std_norm: bool = True  # grpo: divide group-relative advantages by the group's reward std
    clip_low: float = 0.2  # PPO ratio clip below: 1 - clip_low
    clip_high: float = 0.2  # PPO ratio clip above: 1 + clip_high (clip-higher when > clip_low)
    dual_clip: float | None = None  # dual-clip bound c > 1 on the loss of negative advantages; null = off
    tis_cap: float | None = None  # truncated importance sampling against the rollout engine's logprobs; null = off
    mis_low: float | None = None  # reject where trainer / rollout-engine prob ratio < this (in (0, 1)); null = off
    mis_high: float | None = None  # reject where that ratio > this (> 1); set with mis_low; null = off
    mis_level: Literal["token", "sequence"] = "token"  # reject single tokens, or whole sequences by mean log ratio
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy; 0 = no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # KL estimator (Schulman's k1/k2/k3)
    kl_in_reward: bool = False  # fold the KL into per-token rewards (ppo, reinforce_pp) instead of the loss
    kl_target: float | None = None  # with kl_in_reward: adapt kl_coef toward this KL per sequence; null = fixed
    kl_horizon: int = 10000  # adaptive KL controller horizon, in samples
    entropy_coef: float = 0.0  # entropy bonus weight (token mean); > 0 also logs actor/entropy
    gamma: float = 1.0  # ppo, reinforce_pp: discount per token
    lam: float = 0.95  # ppo: GAE lambda
    dynamic_sampling: bool | None = None  # drop groups whose rewards are all equal and sample more; null = dapo only
    max_sampling_rounds: int = 4  # dynamic sampling: most generation rounds per step before giving up
    loss_agg: LossAgg = "token-mean"  # how per-token losses reduce to one number
    kl_loss_agg: LossAgg | None = None  # how the KL loss term (kl_coef, not in reward) reduces; null = loss_agg
    epochs: int = 1  # optimizer passes over each rollout batch
    # With one epoch and no KL in the reward the update is on-policy: the old logprobs are the training
    # forward's own (detached) and no separate forward computes them. True forces that forward anyway.
    recompute_old_logprobs: bool = False
    # MoE only: which routing the policy's training forwards use. none: the trainer's own; r2: the routing
    # of the old-logprob forward of the same batch; r3: the rollout engine's, token by token.
    router_replay: Literal["none", "r2", "r3"] = "none"
    # placement.mode split: a batch may be generated by weights up to this many updates older than the
    # weights it trains (0: synchronous, each batch generated by the weights it trains)
    max_staleness: int = 0
    # On-policy distillation from `teacher:` added to this algorithm: per response token, -distill_coef *
    # (log p_student - log p_teacher) in the token rewards (ppo, reinforce_pp) or the advantages (the others);
    # 0 = off. algo.name: distill uses -(log p_student - log p_teacher) alone as the advantage
    distill_coef: float = 0.0

    def check(self) -> None:
        _at_least(self, 0, "clip_low", "clip_high", "kl_coef", "entropy_coef", "max_staleness", "distill_coef")
        if self.traits.distills and self.distill_coef:
            raise FieldError("distill_coef", "adds the teacher's term to another algorithm; algo.name = 'distill' "
                                             "already trains on it alone: leave distill_coef at 0")
        _at_least(self, 1, "epochs", "max_sampling_rounds", "kl_horizon")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise FieldError("dual_clip", f"must be > 1, got {self.dual_clip}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise FieldError("tis_cap", f"must be > 0, got {self.tis_cap}")
        if (self.mis_low is None) != (self.mis_high is None):
            given, missing = ("mis_low", "mis_high") if self.mis_high is None else ("mis_high", "mis_low")
            raise FieldError(missing, f"must be set together with algo.{given}, the other edge of the band "
                                      "(both null = off)")
        if self.mis_low is not None and not 0 < self.mis_low < 1:
            raise FieldError("mis_low", f"must be in (0, 1), got {self.mis_low}")
        if self.mis_high is not None and not self.mis_high > 1:
            raise FieldError("mis_high", f"must be > 1, got {self.mis_high}")
        if self.kl_target is not None and not self.kl_target > 0:
            raise FieldError("kl_target", f"must be > 0, got {self.kl_target}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise FieldError(name, f"must be in [0, 1], got {getattr(self, name)}")
        if self.kl_in_reward and not self.traits.token_rewards:
            token_rewards = ", ".join(name for name, traits in ALGOS.items() if traits.token_rewards)
            raise ValueError(f"algo.kl_in_reward needs per-token advantages ({token_rewards}); "
                             f"algo.name = {self.name!r} takes the KL as a loss term (kl_in_reward: false)")
        if self.kl_target is not None and not (self.kl_in_reward and self.kl_coef > 0):
            raise ValueError("algo.kl_target adapts the KL coefficient in the reward: it needs "
                             "algo.kl_in_reward: true and algo.kl_coef > 0 (the initial coefficient)")
        if self.traits.surrogate == "gspo":
            if self.loss_agg != "seq-mean-token-mean":
                raise ValueError(f"algo.name = 'gspo' optimizes a mean over sequences of the sequence-level "
                                 f"ratio: algo.loss_agg must be seq-mean-token-mean, got {self.loss_agg!r}")
            if self.dual_clip is not None or self.tis_cap is not None:
                raise ValueError("algo.dual_clip and algo.tis_cap are token-level corrections; "
                                 "algo.name = 'gspo' clips the sequence ratio and takes neither")
            if self.mis_low is not None and self.mis_level == "token":
                raise ValueError("algo.mis_level = 'token' rejects single tokens, which would break the sequence "
                                 "ratio of algo.name = 'gspo'; set algo.mis_level: sequence")

    @property
    def traits(self) -> AlgoTraits:
        """What `name` is: its row of megarl.algo.traits.ALGOS."""
        return ALGOS[self.name]

    @property
    def uses_dynamic_sampling(self) -> bool:
        return self.traits.dynamic_sampling if self.dynamic_sampling is None else self.dynamic_sampling

    @property
    def on_policy(self) -> bool:
        """Whether the policy's old logprobs come from its training forward: one optimizer step per batch
        (`epochs` 1), so the model that computes the loss is the one that would compute the old logprobs,
        and nothing before that step reads them (a KL folded into the rewards does)."""
        kl_in_reward = self.kl_in_reward and self.kl_coef > 0
        return self.epochs == 1 and not kl_in_reward and not self.recompute_old_logprobs and not self.distills

    @property
    def distills(self) -> bool:
        """Whether a teacher scores the samples: the reverse KL (student - teacher logprob per token) is the
        advantage (distill) or a term of it (distill_coef), so the student's logprobs are needed before the update."""
        return self.traits.distills or self.distill_coef > 0


@dataclass(frozen=True)
class CriticConfig:
    """The value model of PPO: the policy's checkpoint (or `path`) with a scalar head, its own optimizer."""

    path: str | None = field(default=None, metadata={"path": "dir"})  # HF checkpoint; null = model.path
    lr: float = 1e-5  # critic Adam learning rate (other Adam settings come from optim)
    value_clip: float | None = 0.2  # clip new values to old +- this in the value loss; null = unclipped

    def check(self) -> None:
        _positive(self, "lr")
        if self.value_clip is not None and not self.value_clip > 0:
            raise FieldError("value_clip", f"must be > 0, got {self.value_clip}")


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher of on-policy distillation (algo.name: distill, or algo.distill_coef > 0): its own HF
    checkpoint, which may be larger than the policy but must share its tokenizer, at the trainer's layout."""

    path: str | None = field(default=None, metadata={"path": "dir"})  # HF checkpoint; null = no teacher


@dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimization (used when algo.name is "dpo")."""

    beta: float = 0.1  # strength of the implicit KL to the reference: reward = beta * (logp - ref_logp)
    loss: Literal["sigmoid", "ipo"] = "sigmoid"  # DPO's logistic loss (Rafailov et al.) or IPO's square (Azar et al.)
    label_smoothing: float = 0.0  # sigmoid only: assumed probability that a pair's label is flipped (cDPO)

    def check(self) -> None:
        _positive(self, "beta")
        if not 0 <= self.label_smoothing < 0.5:
            raise FieldError("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.loss == "ipo" and self.label_smoothing:
            raise FieldError("label_smoothing", "applies to loss 'sigmoid' only; IPO needs 0")


@dataclass(frozen=True)
class RMConfig:
    """Reward-model training (used when algo.name is "rm"): a Bradley-Terry loss on the scalar head's score
    of each pair's chosen and rejected sequence, -log sigmoid(r_chosen - r_rejected) (Ouyang et al. 2022)."""

    # weight of (r_chosen + r_rejected)^2 added to each pair's loss: keeps the scores centred on 0, which
    # the Bradley-Terry loss alone leaves free (Eisenstein et al. 2023); 0 = off
    center_coef: float = 0.0

    def check(self) -> None:
        _at_least(self, 0, "center_coef")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6  # Adam learning rate after warmup
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.999  # Adam second-moment decay
    eps: float = 1e-8  # Adam denominator epsilon
    grad_clip: float = 1.0  # global gradient-norm clip; 0 = off
    warmup_steps: int = 0  # linear learning-rate warmup, in optimizer steps
    distributed: bool = True  # shard optimizer state over data-parallel ranks (Megatron distributed optimizer)
    # the fraction of this rank's optimizer state (Adam moments, fp32 master weights) kept in host memory and
    # stepped there by Megatron's HybridDeviceOptimizer, the rest on the GPU; 0 = off, 1 = all. Needs the
    # distributed optimizer and a 16-bit model.dtype
    cpu_offload: float = 0.0

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): linear warmup over `warmup_steps`, then `lr`."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

    def check(self) -> None:
        _positive(self, "lr", "eps")
        _at_least(self, 0, "weight_decay", "grad_clip", "warmup_steps")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise FieldError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.cpu_offload <= 1:
            raise FieldError("cpu_offload", f"must be in [0, 1] (a fraction of the optimizer state), got "
                                            f"{self.cpu_offload}")
        if self.cpu_offload and not self.distributed:
            # Megatron offloads through its precision-aware optimizer path, which the distributed optimizer owns
            raise FieldError("cpu_offload", "needs the distributed optimizer (optim.distributed: true); Megatron "
                                            "offloads the optimizer state only through it")


@dataclass(frozen=True)
class DataConfig:
    train_path: str = field(metadata={"path": "file"})  # train set (.jsonl or .parquet): prompts (rl), SFT rows or pairs
    eval_path: str | None = field(default=None, metadata={"path": "file"})  # held-out set, same formats; null = no eval
    prompt_key: str = "prompt"  # field of the prompt text
    answer_key: str = "answer"  # field of the reference answer (rl)
    metadata_key: str | None = None  # field holding a mapping handed to rewards as metadata; null = all other fields
    skip_bad_rows: bool = False  # skip malformed rows (counted, with a warning) instead of stopping at the first
    response_key: str = "response"  # field of the target response of an SFT row (sft)
    messages_key: str = "messages"  # field of an SFT row's chat turns [{role, content}]; loss on assistant turns
    chosen_key: str = "chosen"  # field of the preferred response of a pair (dpo, rm)
    rejected_key: str = "rejected"  # field of the dispreferred response of a pair (dpo, rm)
    prompts_per_step: int = 8  # global batch: prompts per RL step (before n_samples), SFT rows or pairs (dpo, rm)
    shuffle: bool = True  # reshuffle the prompt order every epoch (seeded)
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template (sft/dpo: as a user turn)
    eval_every: int = 1  # evaluate every this many steps
    eval_prompts: int = 64  # prompts (SFT rows, pairs) taken from the eval set per evaluation

    def check(self) -> None:
        _at_least(self, 1, "prompts_per_step", "eval_every", "eval_prompts")
        for name in ("train_path", "eval_path"):
            path = getattr(self, name)
            if path is not None and not path.endswith(PROMPT_FILE_SUFFIXES):
                raise FieldError(name, f"expected a {' or '.join(PROMPT_FILE_SUFFIXES)} file, got {path}")


RewardKind = Literal["exact_answer", "math", "format", "length_penalty", "code", "custom", "reward_model", "judge"]
# The options each reward kind reads; any other option set on a term is a mistake the loader reports.
REWARD_TERM_OPTIONS = {
    "exact_answer": (),
    "math": (),
    "format": ("pattern",),
    "length_penalty": ("max_tokens", "cache_tokens"),
    "code": ("sandbox",),
    "custom": ("function",),
    "reward_model": ("path",),
    "judge": ("judge",),
}
JUDGE_TEMPLATE_FIELDS = ("question", "response", "reference")
DEFAULT_JUDGE_TEMPLATE = (
    "Grade the response to the question on a scale from 0 to 10.\n\nQuestion:\n{question}\n\n"
    "Reference answer:\n{reference}\n\nResponse:\n{response}\n\nEnd your reply with a line 'Score: N'.")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run of generated code (megarl/rewards/sandbox.py says which limit is a total of
    the run and which one per process, in each isolation mode), and where the code runs."""

    cpu_s: int = 5  # CPU seconds of each process of one run (RLIMIT_CPU)
    wall_s: float = 10.0  # wall-clock seconds before every process of the run is killed
    memory_mb: int = 512  # memory of the whole run (cgroup mode); of each process otherwise (RLIMIT_AS)
    max_processes: int = 32  # processes and threads alive at once in one run
    disk_mb: int = 64  # size of the run's private writable directory (a tmpfs)
    output_bytes: int = 65536  # most bytes of stdout, and of stderr, read back; the pipe is closed past it
    insecure: bool = False  # run WITHOUT isolation (no bubblewrap): local debugging only, logged as a warning
    service_url: str | None = None  # run code on this external sandbox service (HTTP POST) instead of here
    # a trainer that is not root starts every run as its own uid, and the kernel counts some limits per uid
    # (file descriptors in flight, pipe buffer pages): false runs its sandboxes one at a time, true at once,
    # where one run can make another's calls fail. A root trainer gives each run a uid of its own either way
    share_uid: bool = False

    def check(self) -> None:
        _positive(self, "cpu_s", "wall_s", "memory_mb", "max_processes", "disk_mb", "output_bytes")
        if self.service_url is not None and not self.service_url.startswith(("http://", "https://")):
            raise FieldError("service_url", f"expected an http:// or https:// URL, got {self.service_url!r}")
        if self.service_url is not None and self.insecure:
            raise FieldError("insecure", "has no effect with service_url: the service runs the code")


@dataclass(frozen=True)
class JudgeConfig:
    """A generative model that grades each response (megarl/rewards/judge.py): served behind an
    OpenAI-compatible HTTP endpoint (`url`: SGLang's server, vLLM, a hosted API), or a local HF checkpoint
    (`path`) that megarl's native engine runs in the scoring process. The reward is its score mapped linearly
    from [min_score, max_score] to [0, 1]; a reply without a score in that range fails the sample."""

    url: str | None = None  # the endpoint's base URL, e.g. http://localhost:30000/v1 (/chat/completions follows)
    # or: a local HF causal-LM checkpoint with its tokenizer, run by megarl's native engine in the scoring process
    path: str | None = field(default=None, metadata={"path": "dir"})
    api: Literal["chat", "completions"] = "chat"  # chat: the prompt as one user message; completions: raw text
    model: str = "default"  # the `model` field of each request (url)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the local judge's weights (path)
    # the prompt; {question}, {response} and {reference} (the row's answer, "" without one) are filled in
    template: str = DEFAULT_JUDGE_TEMPLATE
    # regex searched in the reply (the last match counts); its group `score` is the number
    score_pattern: str = r"(?i)score\s*[:=]\s*\**\s*(?P<score>[-+]?\d+(?:\.\d+)?)"
    min_score: float = 0.0  # the lowest score the template asks for: reward 0
    max_score: float = 10.0  # the highest: reward 1
    max_tokens: int = 256  # most tokens of a reply
    temperature: float = 0.0  # sampling temperature of the reply
    timeout_s: float = 60.0  # each request: connecting, and every read of the reply; past it the sample fails
    max_concurrency: int = 8  # most requests in flight at once from one scoring process
    api_key_env: str | None = None  # environment variable holding a bearer token for the endpoint; null = none

    def check(self) -> None:
        if (self.url is None) == (self.path is None):
            raise ValueError("set one of url (an OpenAI-compatible endpoint) and path (a local checkpoint)"
                             + ("" if self.url is None else ", not both"))
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise FieldError("url", f"expected an http:// or https:// URL, got {self.url!r}")
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        except ValueError as e:
            raise FieldError("template", f"not a valid template: {e}") from None
        unknown = sorted(fields - set(JUDGE_TEMPLATE_FIELDS))
        if unknown:
            raise FieldError("template", f"unknown field {{{unknown[0]}}} (fields: "
                                         f"{', '.join('{' + f + '}' for f in JUDGE_TEMPLATE_FIELDS)})")
        if "response" not in fields:
            raise FieldError("template", "has no {response} field: the judge would never see the response")
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as e:
            raise FieldError("score_pattern", f"invalid regex: {e}") from None
        if "score" not in pattern.groupindex:
            raise FieldError("score_pattern", "needs a named group (?P<score>...) holding the number")
        if not self.max_score > self.min_score:
            raise FieldError("max_score", f"must be > min_score = {self.min_score}, got {self.max_score}")
        _positive(self, "timeout_s")
        _at_least(self, 1, "max_tokens", "max_concurrency")
        _at_least(self, 0, "temperature")


@dataclass(frozen=True)
class RewardTermConfig:
    """One weighted term of the reward. The options below `weight` belong to one kind each (the comment
    says which, REWARD_TERM_OPTIONS is the table); setting one for another kind is an error."""

    kind: RewardKind  # exact_answer | math | format | length_penalty | code | custom | reward_model | judge
    weight: float = 1.0  # the term's factor in the summed reward
    pattern: str | None = None  # format: regex searched in the response (re.DOTALL); 1 when found, else 0
    max_tokens: int | None = None  # length_penalty: response length, in tokens, where the penalty reaches -1
    cache_tokens: int | None = None  # length_penalty: the penalty ramps from 0 to -1 over this many tokens
    sandbox: SandboxConfig | None = None  # code: limits of each run; null = the SandboxConfig defaults
    function: str | None = None  # custom: `module:function`, called with prompt, response, answer, metadata
    path: str | None = field(default=None, metadata={"path": "dir"})  # reward_model: HF sequence-classification
    # checkpoint (one label) of the policy's architecture and tokenizer, scored by a Megatron model
    judge: JudgeConfig | None = None  # judge: the grading model's endpoint, prompt template and score parser

    def check(self) -> None:
        used = REWARD_TERM_OPTIONS[self.kind]
        for name in ("pattern", "max_tokens", "cache_tokens", "sandbox", "function", "path", "judge"):
            if getattr(self, name) is not None and name not in used:
                raise FieldError(name, f"is not an option of kind {self.kind!r} "
                                       f"(its options: {', '.join(('weight', *used))})")
        for name in used:
            if getattr(self, name) is None and name != "sandbox":
                raise FieldError(name, f"required for kind {self.kind!r}")
        if self.kind == "format":
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise FieldError("pattern", f"invalid regex: {e}") from None
        if self.kind == "length_penalty":
            _at_least(self, 1, "max_tokens", "cache_tokens")
            if self.cache_tokens > self.max_tokens:
                raise FieldError("cache_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.cache_tokens}")
        if self.kind == "custom":
            module, _, name = self.function.partition(":")
            if not (name.isidentifier() and all(part.isidentifier() for part in module.split("."))):
                raise FieldError("function", f"expected 'module:function', got {self.function!r}")


def _exact_answer_terms() -> list[RewardTermConfig]:
    return [RewardTermConfig(kind="exact_answer")]


@dataclass(frozen=True)
class RewardConfig:
    # Every term here scores one sample from its text. A reward-model term (a value head the trainer runs
    # over the whole batch) is a different kind of thing and would be added to their sum in score().
    terms: list[RewardTermConfig] = field(default_factory=_exact_answer_terms)  # summed, each times its weight
    timeout_s: float = 30.0  # time limit of scoring one sample (all its terms); past it the sample fails
    workers: int = 0  # Ray workers that score in parallel; 0 = score in the trainer process
    ray_address: str | None = None  # Ray cluster for the workers; null = start a local instance
    # Stop the run after this many consecutive steps in which every sample's reward failed (a broken reward
    # function trains on zeros); the error names the term and its first failure. 0 = never stop.
    max_failed_steps: int = 3
    # The reward of a sample that a limit cut off before the model ended it (finish reason length, max_turns,
    # max_tokens or tool_time), in place of its terms', reward models' and environment's sum; null = scored like
    # the others. A reward model never saw an unfinished response: its score there is arbitrary, and RL finds it.
    unfinished: float | None = None

    def check(self) -> None:
        if self.unfinished is not None and not math.isfinite(self.unfinished):
            raise FieldError("unfinished", f"must be a finite number or null, got {self.unfinished}")
        if not self.terms:
            raise FieldError("terms", "needs at least one term")
        _positive(self, "timeout_s")
        _at_least(self, 0, "workers", "max_failed_steps")
        if self.ray_address is not None and self.workers == 0:
            raise FieldError("ray_address", "is set but workers is 0: scoring would not use the cluster")


BUILTIN_ENVS = ("single_turn", "calculator", "python", "retrieval")
# The options each environment reads; any other option set is a mistake the loader reports. A custom
# environment (`module:Class`) is built as Class(**options).
ENV_OPTIONS = {
    "single_turn": (),
    "calculator": (),
    "python": ("sandbox",),
    "retrieval": ("documents_path", "top_k"),
    "custom": ("options",),
}


@dataclass(frozen=True)
class EnvConfig:
    """The environment a rollout talks to (megarl/envs). A trajectory is the prompt, then turns of the model
    and the environment's observations, until the environment says done or a limit below ends it; the
    limit that ended it is its finish reason (max_turns, max_tokens, tool_time), counted in `env/ended_by/*`.
    The default, single_turn, is one model turn: the plain RL rollout."""

    name: str = "single_turn"  # single_turn | calculator | python | retrieval | module:Class (your own)
    max_turns: int = 4  # most model turns per trajectory
    max_tokens: int | None = None  # most response tokens per trajectory, generated and observation; null = no limit
    tool_timeout_s: float = 10.0  # wall-clock limit of one environment step (the tool calls of one turn)
    max_tool_time_s: float = 60.0  # wall-clock limit of all environment steps of one trajectory
    # a step that raises is tried again on a fresh environment (reset, the trajectory's earlier turns given again)
    # up to this many times per trajectory (env/retries counts them); then the trajectory ends with env_error
    retries: int = 2
    tool_workers: int = 8  # threads running the steps of different trajectories concurrently
    tool_format: Literal["qwen", "llama3"] = "qwen"  # tool-call syntax: <tool_call>{json}</tool_call> or Llama 3's
    sandbox: SandboxConfig | None = None  # python: limits of each run; null = the SandboxConfig defaults
    documents_path: str | None = field(default=None, metadata={"path": "file"})  # retrieval: documents JSONL
    top_k: int | None = None  # retrieval: documents returned per search; null = 3
    options: dict[str, Any] | None = None  # module:Class: keyword arguments of the class

    @property
    def kind(self) -> str:
        """The built-in name, or "custom" for `module:Class`."""
        return self.name if self.name in BUILTIN_ENVS else "custom"

    def check(self) -> None:
        if self.name not in BUILTIN_ENVS:
            module, _, cls = self.name.partition(":")
            if not (cls.isidentifier() and all(part.isidentifier() for part in module.split("."))):
                raise FieldError("name", f"expected one of {', '.join(BUILTIN_ENVS)} or 'module:Class', "
                                         f"got {self.name!r}")
        used = ENV_OPTIONS[self.kind]
        for name in ("sandbox", "documents_path", "top_k", "options"):
            if getattr(self, name) is not None and name not in used:
                known = f"its options: {', '.join(used)}" if used else "it takes none"
                raise FieldError(name, f"is not an option of environment {self.name!r} ({known})")
        if self.kind == "retrieval" and self.documents_path is None:
            raise FieldError("documents_path", "required for the retrieval environment "
                                               "(write one with python -m megarl.envs.documents)")
        _at_least(self, 1, "max_turns", "tool_workers")
        _at_least(self, 0, "retries")
        _positive(self, "tool_timeout_s", "max_tool_time_s")
        if self.max_tokens is not None:
            _at_least(self, 1, "max_tokens")
        if self.top_k is not None:
            _at_least(self, 1, "top_k")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10  # optimizer steps
    micro_batch_size: int = 8  # sequences per forward/backward (a DPO pair is two sequences)
    # RL and SFT: when set, sequence packing: each forward/backward is one row of unpadded sequences back to back,
    # at most this many tokens (so at least the longest prompt + response), balanced by tokens; 0/None =
    # off, micro_batch_size padded sequences instead
    micro_batch_tokens: int | None = None
    epochs: int = 0  # sft/dpo/rm: when > 0, train this many passes over the train set instead of `steps`
    # RL: the policy trains only on samples with a non-zero advantage when the others add exactly nothing
    # to its loss and gradients (no KL or entropy term, no critic); they still count in the loss's denominators
    skip_zero_advantage: bool = True
    # RL, with micro_batch_tokens: a group's samples hold their prompt once in a packed row, each response
    # after it at the positions that follow the prompt and attending to it and to itself only: the same
    # outputs and gradients for fewer tokens (prompt + n responses instead of n * (prompt + response))
    share_prompts: bool = False

    def check(self) -> None:
        _at_least(self, 1, "steps", "micro_batch_size")
        _at_least(self, 0, "epochs")
        if self.micro_batch_tokens is not None:
            _at_least(self, 0, "micro_batch_tokens")
        if self.share_prompts and not self.micro_batch_tokens:
            raise FieldError("share_prompts", "lays a group out as one packed row: it needs sequence packing "
                                              "(set train.micro_batch_tokens)")


@dataclass(frozen=True)
class WarmupConfig:
    sft_steps: int = 0  # most supervised steps on the train set's answers before RL; 0 = none
    lr: float = 1e-3  # learning rate of those steps
    batch_size: int = 32  # examples per supervised step
    stop_answer_prob: float = 1.0  # stop early once the mean probability of the whole answer reaches this

    def check(self) -> None:
        _at_least(self, 0, "sft_steps")
        _positive(self, "lr")
        _at_least(self, 1, "batch_size")
        if not 0 < self.stop_answer_prob <= 1:
            raise FieldError("stop_answer_prob", f"must be in (0, 1], got {self.stop_answer_prob}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Resumable checkpoints of the RL loop under RUN_DIR/checkpoints (see megarl.checkpoint)."""

    every_steps: int = 0  # save a resumable checkpoint every this many steps; 0 = only at the end
    save_final: bool = True  # at the end: a resumable checkpoint and the HF export RUN_DIR/checkpoints/final
    keep_last: int = 2  # resumable checkpoints kept on disk, newest first; 0 = keep all
    resume: str = "auto"  # "auto": continue from checkpoints/latest when there is one; "never"; or a checkpoint dir
    # the manifest of each checkpoint holds every file's sha256 beside its size (hashed by all ranks in
    # parallel, at save and before a resume); false: sizes only, which catch truncation but not damage
    checksums: bool = True

    def check(self) -> None:
        _at_least(self, 0, "every_steps", "keep_last")


@dataclass(frozen=True)
class WandbConfig:
    """A Weights & Biases run of the job (the `wandb` extra); the section being present turns it on."""

    project: str = "megarl"  # the W&B project
    entity: str | None = None  # team or user the run belongs to; null: the logged-in account's default
    name: str | None = None  # the run's display name; null: the name of run_dir
    group: str | None = None  # groups related runs in the W&B UI
    tags: list[str] = field(default_factory=list)  # labels of the run
    mode: Literal["online", "offline"] = "online"  # offline: kept under run_dir/wandb, uploaded by `wandb sync`

    def check(self) -> None:
        if not self.project:
            raise FieldError("project", "must not be empty")


@dataclass(frozen=True)
class MlflowConfig:
    """An MLflow run of the job (the `mlflow` extra); the section being present turns it on."""

    tracking_uri: str | None = None  # http(s)://server, file:/dir, sqlite:///file.db; null: MLflow's default
    experiment: str = "megarl"  # created when missing
    name: str | None = None  # the run's name; null: the name of run_dir
    tags: dict[str, str] = field(default_factory=dict)  # extra tags of the run

    def check(self) -> None:
        if not self.experiment:
            raise FieldError("experiment", "must not be empty")


@dataclass(frozen=True)
class LogConfig:
    progress: bool = True  # console progress: a bar on a terminal, else one summary line per logged step
    tensorboard: bool = False  # also write TensorBoard events to run_dir
    wandb: WandbConfig | None = None  # also log to a Weights & Biases run, e.g. {project: math-rl}
    mlflow: MlflowConfig | None = None  # also log to an MLflow run, e.g. {tracking_uri: http://mlflow:5000}
    every_steps: int = 1  # print and record metrics every this many steps
    trace: bool = False  # a step timeline per rank in run_dir/trace/ (Chrome trace; merge: megarl trace RUN_DIR)
    profile_steps: list[int] | None = None  # [a, b]: torch.profiler over steps a..b, traces in run_dir/profile/

    def check(self) -> None:
        _at_least(self, 1, "every_steps")
        if self.profile_steps is not None:
            window = self.profile_steps
            if len(window) != 2 or not 1 <= window[0] <= window[1]:
                raise FieldError("profile_steps", f"must be [first, last] steps with 1 <= first <= last, got {window}")


FaultKind = Literal["kill", "sigterm", "hang", "nan", "disk_full", "engine_crash", "engine_short", "engine_kill",
                    "env_error", "reward_kill", "reward_hang", "sandbox_hang"]


@dataclass(frozen=True)
class FaultConfig:
    """A fault injected on purpose (megarl.inject, docs/faults.md): tools/fault_matrix.py and the tests set it to
    show what a run survives. Never part of a real run."""

    kind: FaultKind  # what happens: megarl.inject lists the kinds
    step: int  # the step it happens in, from 1 (a rollout rank of placement split: its step-th generate call)
    phase: Literal["generate", "train", "checkpoint", "push"] = "train"  # kill, sigterm, hang: when in the step
    rank: int | None = None  # the global rank it happens on; null: every rank

    def check(self) -> None:
        _at_least(self, 1, "step")
        if self.rank is not None:
            _at_least(self, 0, "rank")


@dataclass(frozen=True)
class Config:
    model: ModelConfig  # the policy checkpoint
    data: DataConfig  # prompt sets
    run_dir: str = "runs/default"  # metrics.jsonl, checkpoints and the resolved recipe go here
    seed: int = 0  # seeds data order, sampling and initialization
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # model-parallel layout
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # which ranks generate
    env: EnvConfig = field(default_factory=EnvConfig)  # what the rollout talks to: tools, turns and their limits
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # advantages and loss
    critic: CriticConfig = field(default_factory=CriticConfig)  # value model (algo.name: ppo)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # distillation teacher (algo.name: distill)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # preference loss (algo.name: dpo)
    rm: RMConfig = field(default_factory=RMConfig)  # reward-model loss (algo.name: rm)
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer
    reward: RewardConfig = field(default_factory=RewardConfig)  # scoring
    train: TrainConfig = field(default_factory=TrainConfig)  # training schedule
    warmup: WarmupConfig = field(default_factory=WarmupConfig)  # optional supervised warm start
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saving
    log: LogConfig = field(default_factory=LogConfig)  # console and metric output
    faults: list[FaultConfig] = field(default_factory=list)  # injected faults (megarl.inject): tests only

    def check(self) -> None:
        n, prompts, micro = self.rollout.n_samples, self.data.prompts_per_step, self.train.micro_batch_size
        traits = self.algo.traits
        if traits.pairs and micro % 2:
            # pairs are interleaved (chosen, rejected) in the batch; an odd micro-batch would split one
            raise ValueError(f"algo.name = {self.algo.name!r} needs an even train.micro_batch_size (a pair is two "
                             f"sequences kept in one micro-batch), got {micro}")
        self.check_teacher()
        if any(f.kind == "reward_kill" for f in self.faults) and not self.reward.workers:
            raise ValueError("faults: a reward_kill fault kills the process that scores, which without "
                             "reward.workers is the trainer: set reward.workers > 0")
        if self.optim.cpu_offload and self.model.dtype == "float32":
            # Megatron's distributed optimizer hands an fp32 model's shards to the HybridDeviceOptimizer as views
            # of the parameters, which torch's optimizers refuse ("can't optimize a non-leaf Tensor")
            raise ValueError(f"optim.cpu_offload = {self.optim.cpu_offload:g} needs a 16-bit model.dtype (bfloat16 "
                             "or float16): Megatron's offloading optimizer cannot step float32 parameters")
        if self.model.lora is not None and traits.scalar_head:
            raise ValueError("model.lora: adapters go on the policy; algo.name = 'rm' trains a scalar-head model, "
                             "all of it (remove model.lora)")
        if traits.offline:
            if self.placement.mode == "split":
                raise ValueError(f"placement.mode = 'split' gives generation ranks of their own; algo.name = "
                                 f"{self.algo.name!r} generates nothing: use placement.mode: colocated")
            if self.train.micro_batch_tokens and not traits.packs:
                raise ValueError(f"train.micro_batch_tokens (sequence packing) is for the RL and SFT loops; "
                                 f"algo.name = {self.algo.name!r} uses train.micro_batch_size")
            self.check_packing_layout()
            return
        self.check_placement()
        if self.rollout.lora_sync == "adapter":
            if self.model.lora is None:
                raise ValueError("rollout.lora_sync = 'adapter' hands the engines a LoRA policy's adapters, but "
                                 "model.lora is not set: the whole model trains (use rollout.lora_sync: merged)")
            if self.placement.mode == "split":
                raise ValueError("rollout.lora_sync = 'adapter' is for colocated placement; split placement's "
                                 "rollout ranks take the merged weights (rollout.lora_sync: merged)")
        if self.train.share_prompts:
            self.check_share_prompts()
        self.check_packing_layout()
        if n * prompts % micro and not self.train.micro_batch_tokens:
            raise ValueError(
                f"rollout.n_samples * data.prompts_per_step = {n} * {prompts} = {n * prompts} samples per step"
                f" is not divisible by train.micro_batch_size = {micro}"
            )
        if (traits.groups or self.algo.uses_dynamic_sampling) and n < 2:
            raise ValueError(
                f"algo.name = {self.algo.name!r} compares samples within a group and needs"
                f" rollout.n_samples >= 2, got {n}"
            )

    def check_teacher(self) -> None:
        if self.algo.traits.offline and (self.algo.distill_coef or self.teacher.path is not None):
            key = "algo.distill_coef" if self.algo.distill_coef else "teacher.path"
            raise ValueError(f"{key}: on-policy distillation scores generated samples; algo.name = "
                             f"{self.algo.name!r} generates none")
        if self.algo.distills and self.teacher.path is None:
            what = "algo.name = 'distill'" if self.algo.traits.distills else "algo.distill_coef > 0"
            raise ValueError(f"{what} distills from a teacher: set teacher.path (an HF checkpoint)")
        if self.teacher.path is not None and not self.algo.distills:
            raise ValueError("teacher.path is set but nothing reads it: set algo.name: distill, or algo.distill_coef "
                             "> 0 to add the teacher's term to this algorithm")

    def check_packing_layout(self) -> None:
        if self.train.micro_batch_tokens and self.parallel.cp > 1:
            # context parallelism cuts each padded row into 2 * cp chunks; packed rows are not split
            raise ValueError(f"train.micro_batch_tokens (sequence packing) cannot be combined with parallel.cp = "
                             f"{self.parallel.cp} (context parallelism); turn one of them off")

    def check_share_prompts(self) -> None:
        if self.rollout.n_samples < 2:
            raise ValueError("train.share_prompts holds a group's prompt once for its samples, but "
                             "rollout.n_samples = 1 draws one sample per prompt: there is nothing to share")
        if self.parallel.cp > 1:
            # context parallelism splits each padded row into 2 * cp chunks; a shared row would need the
            # prompt's keys on every rank that holds one of its responses
            raise ValueError(f"train.share_prompts cannot be combined with parallel.cp = {self.parallel.cp} "
                             "(context parallelism): a shared row is a packed row, which is not split over "
                             "context-parallel ranks")

    def check_placement(self) -> None:
        split = self.placement.mode == "split"
        if self.algo.max_staleness and not split:
            raise ValueError(f"algo.max_staleness = {self.algo.max_staleness} lets generation run ahead of "
                             "training, which needs rollout ranks of their own: set placement.mode: split")
        if not split:
            return
        if self.placement.rollout_ranks % self.rollout.tp:
            raise ValueError(f"placement.rollout_ranks = {self.placement.rollout_ranks} is not a multiple of "
                             f"rollout.tp = {self.rollout.tp}: every rollout engine spans rollout.tp of them")


def load_config(path: str | Path, overrides: Sequence[str] = (), *, check_paths: bool = True) -> Config:
    """Read a recipe, apply `key.path=value` overrides (values parsed as YAML), and build a checked Config
    (megarl.dataclass_yaml.load_dataclass).

    Path fields come back absolute (resolved against the current directory). Raises ConfigError.
    `check_paths=False` checks everything but the existence of the files and directories the recipe names,
    and leaves those paths as written: `megarl plan` validates a recipe for a cluster whose checkpoints and
    data this machine does not have.
    """
    return load_dataclass(Config, path, overrides, check_paths=check_paths)
