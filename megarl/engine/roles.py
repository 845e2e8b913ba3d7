"""The one place a run's models become train engines. Which models a run has, and each one's checkpoint, shape,
optimizer and head, is resolved once (megarl.job: the run's cast of `ModelRole`s); `build_engine` builds one of
them with the run's dtype, Megatron settings and layer spec."""

from __future__ import annotations

from torch import Tensor

from megarl.engine.lora import adapters_off
from megarl.engine.megatron import TrainEngine
from megarl.engine.parallel import ParallelGroups
from megarl.job import Job, ModelRole


def make_engine(role: ModelRole, groups: ParallelGroups, *, dtype: str, megatron: dict, te_layers: bool,
                seed: int) -> TrainEngine:
    """A TrainEngine for `role` at dtype `dtype`, with TransformerConfig fields `megatron`, on Transformer
    Engine's layers or Megatron's local ones (`te_layers`); `seed` draws a LoRA actor's adapters."""
    if role.shares_actor:
        raise ValueError(f"the {role.name} of this run is the actor with its adapters off: it has no engine of its own")
    return TrainEngine(model_dir=role.checkpoint, shape=role.shape, dtype=dtype, megatron=megatron, groups=groups,
                       optim=role.optim, value_head=role.value_head, lora=role.lora, seed=seed, te_layers=te_layers)


def build_engine(job: Job, role: ModelRole, groups: ParallelGroups, *,
                 actor: TrainEngine | None = None) -> TrainEngine | BasePolicy:
    """The train engine of `role`, a model of `job`'s cast, on this rank's share of the layout. The reference of a
    LoRA run (`role.shares_actor`) is `actor` with its adapters off: the base model exactly, at no memory."""
    if role.shares_actor:
        return BasePolicy(actor)
    return make_engine(role, groups, dtype=job.cfg.model.dtype, megatron=job.megatron, te_layers=job.te_layers,
                       seed=job.cfg.seed)


class BasePolicy:
    """The reference policy of a LoRA run: the actor with its adapters off, computed by the actor's engine.
    It answers what a frozen reference engine answers (`logprobs`) and holds no memory of its own."""

    def __init__(self, actor: TrainEngine):
        self.actor = actor

    def logprobs(self, tokens: Tensor, **kwargs) -> Tensor:
        """The base model's token logprobs [B, T] (TrainEngine.logprobs)."""
        with adapters_off(self.actor.chunks):
            return self.actor.logprobs(tokens, **kwargs)
