"""The RL objective of a recipe, resolved once: advantage estimator, KL controller, policy and critic losses.

`algo/` holds the math as pure functions; this module reads the recipe's `algo` (and `critic`) section once,
when a run is built, and returns plain objects with explicit terms and coefficients. Each loss declares the
batch fields it reads (`fields`), so the loop hands the engine exactly those, and nothing is decided per
micro-batch from which keys happen to be present.

    objective = policy_objective(cfg.algo, on_policy=cfg.algo.on_policy)
    loss_fn = partial(objective, norm=global_loss_norm(batch.response_mask, group=dp))
    engine.train_step(batch.tokens, objective.inputs(batch), loss_fn, entropy=objective.needs_entropy, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from megarl.algo.advantages import (AdaptiveKLController, FixedKLController, broadcast_to_tokens, gae,
                                     grpo_advantages, kl_penalized_token_rewards, reinforce_pp_advantages,
                                     reinforce_pp_baseline_advantages, rloo_advantages, whiten)
from megarl.algo.aggregate import LossNorm, aggregate, masked_mean
from megarl.algo.kl import kl_estimate, reverse_kl
from megarl.algo.losses import gspo_loss, ppo_clip_loss, rollout_rejection_mask, value_loss
from megarl.batch import RolloutBatch
from megarl.config import AlgoConfig, RecipeError

# (batch with rewards, old/ref logprobs and values, kl_coef) -> (advantages [B, T], returns [B, T] or None)
AdvantageFn = Callable[[RolloutBatch, float], tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class PolicyObjective:
    """The policy loss of one micro-batch, as a contribution to the global-batch loss:

        loss = surrogate (aggregated by `loss_agg`)
             + kl_coef * KL(pi || pi_ref) (aggregated by `kl_agg`; a term only when kl_coef > 0)
             - entropy_coef * entropy (token mean; a term only when entropy_coef > 0)

    The surrogate is PPO-clip (with clip-higher, dual clip and truncated importance sampling against the
    rollout engine's logprobs when set) or GSPO's sequence-ratio clip. Every term is computed on response
    tokens only. Statistics (clip fraction, PPO KL, TIS weight, masked fraction, KL, entropy) are token means
    over the global batch.

    `mis_low`/`mis_high` (masked importance sampling, `rollout_rejection_mask`): tokens, or whole sequences
    (`mis_level`), whose ratio trainer / rollout-engine probability leaves [mis_low, mis_high] or is not a
    number get a surrogate loss of exactly 0 and a policy gradient of exactly 0, whatever their ratios (every
    factor of the surrogate's local derivative is finite: bounded log-ratios, TIS weights in [0, tis_cap]).
    They stay in the aggregation's denominators (the global batch's counts): rejecting tokens does not scale
    up the gradient of the others, as in IcePop. TIS, when also on, weights the tokens that are kept; without
    MIS, TIS gives weight 0 to a token whose rollout logprob is not finite. The KL and entropy terms are not
    masked.

    `on_policy`: the old logprobs are the detached logprobs of this very forward (AlgoConfig.on_policy: one
    optimizer step per batch, so they are what a separate forward of the same weights would compute), and
    the batch does not carry them.
    """

    surrogate: Literal["ppo", "gspo"]
    loss_agg: str
    clip_low: float
    clip_high: float
    dual_clip: float | None = None
    tis_cap: float | None = None
    mis_low: float | None = None
    mis_high: float | None = None
    mis_level: Literal["token", "sequence"] = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_agg: str = "token-mean"
    entropy_coef: float = 0.0
    on_policy: bool = False

    @property
    def fields(self) -> tuple[str, ...]:
        """The RolloutBatch fields the loss reads, each [B, T]."""
        return ("response_mask", *(() if self.on_policy else ("old_logprobs",)), "advantages",
                *(("ref_logprobs",) if self.kl_coef > 0 else ()),
                *(("rollout_logprobs",) if self.tis_cap is not None or self.rejects else ()))

    @property
    def rejects(self) -> bool:
        """Whether tokens or sequences whose rollout ratio leaves the mis band are rejected."""
        return self.mis_low is not None

    @property
    def inert_at_zero_advantage(self) -> bool:
        """Whether a sample whose advantage is zero on every token adds exactly zero to the loss and its
        gradients: every term is the surrogate's (PPO-clip or GSPO, times TIS weights and MIS masks), which
        scales with the advantage. A KL or entropy term reaches every sample."""
        return self.kl_coef == 0 and self.entropy_coef == 0

    @property
    def needs_entropy(self) -> bool:
        """Whether the engine must compute the per-token entropy (a loss term, and the `entropy` metric)."""
        return self.entropy_coef > 0

    def inputs(self, batch: RolloutBatch) -> dict[str, Tensor]:
        return {name: getattr(batch, name) for name in self.fields}

    def __call__(self, logprobs: Tensor, mb: dict[str, Tensor], *, norm: LossNorm, stats_norm: LossNorm | None = None,
                 entropy: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """logprobs [b, T] (with grad), `mb` the micro-batch's slice of `inputs(batch)`, `entropy` [b, T]
        when `needs_entropy`; norm: the global batch's counts. `stats_norm`: the counts the statistics are
        means over, when the trainer runs only part of the batch (`zero_advantage_split`); default `norm`.
        Returns (loss, statistics)."""
        mask = mb["response_mask"]
        old = logprobs.detach() if self.on_policy else mb["old_logprobs"]
        token_mean = partial(aggregate, mask=mask, mode="token-mean", norm=stats_norm or norm)
        if self.surrogate == "gspo":
            per_token, stats = gspo_loss(logprobs, old, masked_mean(mb["advantages"], mask, dim=-1),
                                         mask, clip_low=self.clip_low, clip_high=self.clip_high)
        else:
            per_token, stats = ppo_clip_loss(logprobs, old, mb["advantages"], mask,
                                             clip_low=self.clip_low, clip_high=self.clip_high,
                                             dual_clip=self.dual_clip, rollout_logprobs=mb.get("rollout_logprobs"),
                                             tis_cap=self.tis_cap)
        if self.rejects:
            keep = rollout_rejection_mask(old, mb["rollout_logprobs"], mask, low=self.mis_low, high=self.mis_high,
                                          level=self.mis_level)
            # zeroed, not removed: `aggregate` still divides by the counts in `norm`, which include these tokens.
            # Their gradient is 0 times the surrogate's local derivative, which the losses keep finite (a NaN
            # there, from a NaN TIS weight once, would make it NaN)
            per_token = torch.where(keep.bool(), per_token, 0.0)
        loss = aggregate(per_token, mask, mode=self.loss_agg, norm=norm)
        out = {"pg_loss": loss.detach(), "clipfrac": token_mean(stats["clipped"]),
               "ppo_kl": token_mean(stats["approx_kl"])}
        if self.tis_cap is not None:
            out["tis_weight_mean"] = token_mean(stats["tis_weight"])
        if self.rejects:
            out["mis_masked_frac"] = token_mean(1.0 - keep)
        if self.kl_coef > 0:
            per_token_kl = kl_estimate(logprobs, mb["ref_logprobs"], kind=self.kl_estimator, mask=mask)
            kl = aggregate(per_token_kl, mask, mode=self.kl_agg, norm=norm)
            loss = loss + self.kl_coef * kl
            out["kl"] = token_mean(per_token_kl.detach())
        if self.needs_entropy:
            loss = loss - self.entropy_coef * aggregate(entropy, mask, mode="token-mean", norm=norm)
            out["entropy"] = token_mean(entropy.detach())
        out["loss"] = loss.detach()
        return loss, out


def policy_objective(algo: AlgoConfig, *, on_policy: bool = False) -> PolicyObjective:
    """The recipe's policy loss. The KL to the reference is a loss term when `algo.kl_coef` > 0 and the KL
    is not folded into the rewards (`algo.kl_in_reward`); it is aggregated like the surrogate unless
    `algo.kl_loss_agg` says otherwise. With `on_policy` (a run passes `algo.on_policy`) the old logprobs
    come from the training forward, not the batch."""
    kl_in_loss = algo.kl_coef > 0 and not algo.kl_in_reward
    return PolicyObjective(
        surrogate=algo.traits.surrogate, loss_agg=algo.loss_agg,
        clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip, tis_cap=algo.tis_cap,
        mis_low=algo.mis_low, mis_high=algo.mis_high, mis_level=algo.mis_level,
        kl_coef=algo.kl_coef if kl_in_loss else 0.0, kl_estimator=algo.kl_estimator,
        kl_agg=algo.kl_loss_agg or algo.loss_agg, entropy_coef=algo.entropy_coef, on_policy=on_policy)


@dataclass(frozen=True)
class CriticObjective:
    """PPO's clipped value loss of one micro-batch, token mean over the global batch. The statistics include
    the token means of R, R^2, R - V and (R - V)^2, from which the explained variance is formed
    (`explained_variance`)."""

    value_clip: float | None
    fields = ("response_mask", "values", "returns")

    def inputs(self, batch: RolloutBatch) -> dict[str, Tensor]:
        return {name: getattr(batch, name) for name in self.fields}

    def __call__(self, values: Tensor, mb: dict[str, Tensor], *, norm: LossNorm) -> tuple[Tensor, dict]:
        mask = mb["response_mask"]
        per_token, stats = value_loss(values, mb["values"], mb["returns"], mask, clip=self.value_clip)
        token_mean = partial(aggregate, mask=mask, mode="token-mean", norm=norm)
        loss = token_mean(per_token)
        error = mb["returns"] - values.detach()
        return loss, {"critic/loss": loss.detach(), "critic/clipfrac": token_mean(stats["vf_clipped"]),
                      "critic/values_mean": token_mean(values.detach()),
                      "returns_mean": token_mean(mb["returns"]), "returns_sq_mean": token_mean(mb["returns"].square()),
                      "error_mean": token_mean(error), "error_sq_mean": token_mean(error.square())}


def explained_variance(metrics: dict[str, float]) -> dict[str, float]:
    """The critic's metrics with its moment statistics replaced by critic/explained_var = 1 - Var(R - V) /
    Var(R) over the response tokens of the global batch: 0 for a constant critic, 1 for a perfect one."""
    metrics = dict(metrics)
    returns_var = metrics.pop("returns_sq_mean") - metrics.pop("returns_mean") ** 2
    error_var = metrics.pop("error_sq_mean") - metrics.pop("error_mean") ** 2
    metrics["explained_var"] = 1.0 - error_var / returns_var if returns_var > 0 else 0.0
    return {k if k.startswith("critic/") else f"critic/{k}": v for k, v in metrics.items()}


def advantage_fn(algo: AlgoConfig, *, group) -> AdvantageFn:
    """The recipe's advantage estimator, as (batch, kl_coef) -> (advantages [B, T], returns [B, T] or None).

    Sequence rewards are the recipe's reward terms. PPO and REINFORCE++ work on per-token rewards, where a
    KL penalty in the reward (algo.kl_in_reward) is added; `group` is the DP group over which token
    advantages are whitened.

    Distillation (the batch's teacher_logprobs, with old_logprobs the student's): `distill` takes
    -reverse_kl per token as the advantage, no baseline, no critic, no group. With `algo.distill_coef` > 0 any
    other algorithm adds -distill_coef * reverse_kl per token: to the token rewards of PPO and REINFORCE++ (so
    GAE and the reward-to-go carry it), to the estimator's advantages for the others.
    """
    def rewards(batch: RolloutBatch) -> Tensor:
        return batch.rewards

    def distill_term(batch: RolloutBatch) -> Tensor:  # [B, T]
        return -reverse_kl(batch.old_logprobs, batch.teacher_logprobs, batch.response_mask)

    def token_rewards(batch: RolloutBatch, kl_coef: float) -> Tensor:
        kl = torch.zeros_like(batch.response_mask, dtype=torch.float32)
        if algo.kl_in_reward and batch.ref_logprobs is not None:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kind=algo.kl_estimator,
                             mask=batch.response_mask)
        out = kl_penalized_token_rewards(rewards(batch), kl, batch.response_mask, kl_coef=kl_coef)
        return out + algo.distill_coef * distill_term(batch) if algo.distill_coef else out

    def per_sequence(estimator) -> AdvantageFn:
        return lambda batch, kl_coef: (
            broadcast_to_tokens(estimator(rewards(batch), batch.group_ids), batch.response_mask), None)

    match algo.traits.estimator:
        case "gae":
            def ppo(batch: RolloutBatch, kl_coef: float) -> tuple[Tensor, Tensor]:
                adv, returns = gae(token_rewards(batch, kl_coef), batch.values, batch.response_mask,
                                   gamma=algo.gamma, lam=algo.lam)
                return whiten(adv, batch.response_mask, group=group), returns
            return ppo
        case "reinforce_pp":
            return lambda batch, kl_coef: (reinforce_pp_advantages(token_rewards(batch, kl_coef),
                                                                   batch.response_mask, gamma=algo.gamma,
                                                                   group=group), None)
        case "distill":
            return lambda batch, kl_coef: (distill_term(batch), None)
        case "grpo":
            estimate = per_sequence(partial(grpo_advantages, std_norm=algo.std_norm))
        case "dr_grpo":
            estimate = per_sequence(partial(grpo_advantages, std_norm=False))
        case "rloo":
            estimate = per_sequence(rloo_advantages)
        case "reinforce_pp_baseline":
            def estimate(batch: RolloutBatch, kl_coef: float) -> tuple[Tensor, None]:
                return reinforce_pp_baseline_advantages(rewards(batch), batch.group_ids, batch.response_mask,
                                                        group=group), None
        case _:
            raise RecipeError(f"algo.name: unknown estimator {algo.name!r}")
    if not algo.distill_coef:
        return estimate

    def with_teacher(batch: RolloutBatch, kl_coef: float) -> tuple[Tensor, None]:
        advantages, _ = estimate(batch, kl_coef)
        return advantages + algo.distill_coef * distill_term(batch), None
    return with_teacher


def kl_controller(algo: AlgoConfig) -> FixedKLController | AdaptiveKLController:
    """The KL coefficient of the reward penalty: adaptive toward `algo.kl_target` (Ziegler et al. 2019) when
    one is set, else fixed at `algo.kl_coef`."""
    if algo.kl_target is not None:
        return AdaptiveKLController(algo.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon)
    return FixedKLController(algo.kl_coef)
