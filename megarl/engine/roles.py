"""The one place a recipe's models become train engines: actor, reference, critic, reward model (frozen, or
trained by the reward-model loop), distillation teacher and the supervised warm start's model, each with the
optimizer (or none) its role needs."""

from __future__ import annotations

import dataclasses
from typing import Literal

from torch import Tensor

from megarl.config import Config
from megarl.engine.lora import adapters_off
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups

# actor: the trained policy; reference: frozen policy for the KL; critic: PPO's value model (scalar head,
# its own learning rate); reward_model: a frozen scalar head scoring whole sequences; rm: the scalar-head
# model the reward-model loop trains (the recipe's optimizer); warmup: the policy of the supervised warm start
# (its own learning rate, no learning-rate warmup); teacher: the frozen model of on-policy distillation (its own
# checkpoint, built like the reference).
Role = Literal["actor", "reference", "critic", "reward_model", "rm", "warmup", "teacher"]


def make_engine(cfg: Config, groups: ParallelGroups, *, role: Role, model_dir: str) -> TrainEngine:
    """A TrainEngine for `role` over the HF checkpoint in `model_dir`, at the recipe's dtype and Megatron
    settings."""
    common = dict(model_dir=model_dir, dtype=cfg.model.dtype, megatron=cfg.model.megatron, groups=groups)
    match role:
        case "actor":
            return TrainEngine(**common, optim=cfg.optim, lora=cfg.model.lora, seed=cfg.seed)
        case "reference" | "teacher":
            return TrainEngine(**common)
        case "critic":
            return TrainEngine(**common, optim=dataclasses.replace(cfg.optim, lr=cfg.critic.lr), value_head=True)
        case "reward_model":
            return TrainEngine(**common, value_head=True)
        case "rm":
            return TrainEngine(**common, optim=cfg.optim, value_head=True)
        case "warmup":
            return TrainEngine(**common, optim=dataclasses.replace(cfg.optim, lr=cfg.warmup.lr, warmup_steps=0))
    raise ValueError(f"unknown engine role {role!r}")


def reference_policy(cfg: Config, groups: ParallelGroups, actor: TrainEngine, *,
                     model_dir: str) -> TrainEngine | BasePolicy:
    """The frozen policy a KL term or DPO compares with: a model of its own, or with model.lora the actor with
    its adapters off, which is the base model exactly and costs no memory."""
    if cfg.model.lora is not None:
        return BasePolicy(actor)
    return make_engine(cfg, groups, role="reference", model_dir=model_dir)


class BasePolicy:
    """The reference policy of a LoRA run: the actor with its adapters off, computed by the actor's engine.
    It answers what a frozen reference engine answers (`logprobs`) and holds no memory of its own."""

    def __init__(self, actor: TrainEngine):
        self.actor = actor

    def logprobs(self, tokens: Tensor, **kwargs) -> Tensor:
        """The base model's token logprobs [B, T] (TrainEngine.logprobs)."""
        with adapters_off(self.actor.chunks):
            return self.actor.logprobs(tokens, **kwargs)
