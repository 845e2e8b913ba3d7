"""The one place a recipe's models become train engines: actor, reference, critic, reward model (frozen, or
trained by the reward-model loop) and the supervised warm start's model, each with the optimizer (or none)
its role needs."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megarl.config import Config
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups

# actor: the trained policy; reference: frozen policy for the KL; critic: PPO's value model (scalar head,
# its own learning rate); reward_model: a frozen scalar head scoring whole sequences; rm: the scalar-head
# model the reward-model loop trains (the recipe's optimizer); warmup: the policy of the supervised warm start
# (its own learning rate, no learning-rate warmup).
Role = Literal["actor", "reference", "critic", "reward_model", "rm", "warmup"]


def make_engine(cfg: Config, groups: ParallelGroups, *, role: Role, model_dir: str) -> TrainEngine:
    """A TrainEngine for `role` over the HF checkpoint in `model_dir`, at the recipe's dtype and Megatron
    settings."""
    common = dict(model_dir=model_dir, dtype=cfg.model.dtype, megatron=cfg.model.megatron, groups=groups)
    match role:
        case "actor":
            return TrainEngine(**common, optim=cfg.optim)
        case "reference":
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
