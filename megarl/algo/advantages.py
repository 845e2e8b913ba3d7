"""Advantages, returns, reward shaping and KL coefficient control.

Shapes: B samples (responses), T padded response length. `mask` is `[B, T]` over response tokens; any nonzero
entry is a valid token. `group_ids` is `[B]` long: samples drawn for the same prompt share an id; groups need not
be contiguous and may differ in size. Token outputs are 0 on masked positions.
"""

import torch
from torch import Tensor

from megarl.algo.aggregate import masked_mean


def _group_sums(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample (sum over its group, size of its group), both `[B]`, for `values` [B] and `group_ids` [B]."""
    _, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(sizes.numel(), dtype=values.dtype, device=values.device).index_add_(0, index, values)
    return sums[index], sizes[index].to(values.dtype)


def _as_float(rewards: Tensor) -> Tensor:
    """Integer rewards (0/1 verifiers) as the default float dtype; float tensors pass through unchanged."""
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def _above_group_min(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """`[B]` float64: each reward minus the smallest of its group. Group statistics are taken on these: a group
    of equal rewards is exactly 0 throughout, so its advantage is exactly 0 whatever the dtype, which the
    trainer's skipping of zero-advantage samples relies on (the float32 mean of eight float32 rewards of 0.1
    is 7e-9 above them, and GRPO's std division turns that into an advantage of -0.0074)."""
    rewards = rewards.double()
    groups, index = torch.unique(group_ids, return_inverse=True)
    low = torch.full((groups.numel(),), torch.inf, dtype=rewards.dtype, device=rewards.device)
    return rewards - low.scatter_reduce(0, index, rewards, reduce="amin")[index]


def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath).

    rewards: `[B]` float; group_ids: `[B]` long. Returns `[B]`, in the rewards' float dtype.
    std_norm=True:  (r - mean_g) / (std_g + eps)
    std_norm=False: r - mean_g                     (Dr. GRPO, Liu et al. 2025)
    mean_g divides by the group size n; std_g is the unbiased estimate (divides by n - 1), as torch.std and
    the reference implementations use. Computed in float64 on rewards shifted by their group's minimum (which
    cancels), so a group of size 1 and a group with equal rewards have exactly 0.
    """
    dtype = _as_float(rewards).dtype
    shifted = _above_group_min(rewards, group_ids)
    sums, sizes = _group_sums(shifted, group_ids)
    centered = shifted - sums / sizes
    if not std_norm:
        return centered.to(dtype)
    sq_sums, _ = _group_sums(centered.square(), group_ids)
    # size-1 groups: the squared deviation is 0, so clamping n - 1 to 1 yields std 0 and advantage 0
    std = (sq_sums / (sizes - 1).clamp(min=1)).sqrt()
    return (centered / (std + eps)).to(dtype)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantages (RLOO, Ahmadian et al. 2024).

    rewards: `[B]` float; group_ids: `[B]` long. Returns `[B]`, in the rewards' float dtype:
    r_i - (sum_g - r_i) / (n - 1), the mean of the other n - 1 samples of the group. A size-1 group gets 0.
    Computed as `grpo_advantages` is, so a group with equal rewards gets exactly 0.
    """
    dtype = _as_float(rewards).dtype
    shifted = _above_group_min(rewards, group_ids)
    sums, sizes = _group_sums(shifted, group_ids)
    others = (sums - shifted) / (sizes - 1).clamp(min=1)
    return torch.where(sizes > 1, shifted - others, 0.0).to(dtype)


def reinforce_pp_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Discounted reward-to-go over valid tokens (REINFORCE++, Hu 2025).

    token_rewards, mask: `[B, T]`. Returns `[B, T]`: G_t = r_t + gamma * G_next, where "next" is the next VALID
    token; masked tokens neither add reward nor consume a discount step, and get G = 0. With right padding
    this is the plain reward-to-go; with masked spans inside a response (tool output) the reward flows across.
    """
    valid = mask.bool()
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(valid[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return returns


def whiten(values: Tensor, mask: Tensor, *, group=None, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Masked whitening with statistics over all valid tokens of all ranks in `group`.

    values, mask: `[B, T]`. Returns `[B, T]`, 0 on masked tokens:
      shift_mean=True:  (v - mean) / sqrt(var + eps)
      shift_mean=False: (v - mean) / sqrt(var + eps) + mean   (rescale only; the mean is kept)
    mean and var divide by the number of valid tokens N over the group (population variance: the goal is unit
    variance on this batch, not an estimate). group: None is local; otherwise sums and counts are all-reduced,
    so every rank uses the statistics of the concatenated batch. Computed in float64 and returned in the dtype
    of `values`: the float64 mean of N < 2**29 equal float32 values is exact, so a constant float32 batch
    whitens to exactly 0 (shift_mean=True).
    """
    valid = mask.bool()
    values64 = values.double()
    mean = masked_mean(values64, valid, group=group)
    var = masked_mean((values64 - mean).square(), valid, group=group)
    whitened = (values64 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, 0.0).to(values.dtype)


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, group=None) -> Tensor:
    """REINFORCE++ advantages (Hu 2025): reward-to-go whitened over the global batch.

    token_rewards, mask: `[B, T]` (token_rewards typically from `kl_penalized_token_rewards`). Returns `[B, T]`
    = whiten(reinforce_pp_returns(token_rewards, mask, gamma=gamma), mask, group=group); see both for the means.
    """
    return whiten(reinforce_pp_returns(token_rewards, mask, gamma=gamma), mask, group=group)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, mask: Tensor, *, group=None) -> Tensor:
    """REINFORCE++-baseline advantages (Hu 2025): group-mean baseline, then global whitening.

    rewards: `[B]`; group_ids: `[B]` long; mask: `[B, T]`. Returns `[B, T]`: r_i minus the mean reward of its
    group (denominator: group size), broadcast to the valid tokens, then `whiten` over all valid tokens of the
    DP `group` (denominator: valid-token count of the concatenated batch). Prompt groups must not span ranks.
    """
    centered = grpo_advantages(rewards, group_ids, std_norm=False)
    return whiten(broadcast_to_tokens(centered, mask), mask, group=group)


def reinforce_baseline_advantages(rewards: Tensor, baseline: Tensor | float) -> Tensor:
    """Plain REINFORCE with a baseline (Williams 1992): rewards `[B]` - baseline (`[B]` or scalar) -> `[B]`."""
    return rewards - baseline


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016).

    token_rewards, values, mask: `[B, T]`. Returns (advantages, returns), both `[B, T]` and 0 on masked tokens.
    delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next;  returns = A + V, computed here,
    before any whitening of A. "next" is the next valid token: the state after the last valid token is terminal
    (V = 0), so right padding ends the episode; masked tokens inside a response are skipped, rewards on them
    are ignored.
    """
    valid = mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(valid[:, t], adv, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], adv, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence values `[B]` copied onto every valid token: `[B, T]`, 0 on masked tokens."""
    seq_values = _as_float(seq_values)
    return torch.where(mask.bool(), seq_values[:, None], 0.0)


def kl_penalized_token_rewards(rewards: Tensor, kl: Tensor, mask: Tensor, *, kl_coef: float) -> Tensor:
    """Token rewards with the KL penalty folded in (KL in reward: Ziegler et al. 2019, InstructGPT).

    rewards: `[B]` sequence rewards; kl: `[B, T]` per-token KL estimate (`kl_estimate`); mask: `[B, T]`.
    Returns `[B, T]`: -kl_coef * kl on every valid token plus the sequence reward on the last valid token;
    0 on masked tokens. A sequence with no valid token receives nothing.
    """
    valid = mask.bool()
    token_rewards = torch.where(valid, -kl_coef * kl, 0.0)
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (valid * positions).argmax(dim=1)  # index of the last valid token; 0 for an empty row
    bonus = torch.where(valid.any(dim=1), _as_float(rewards).to(token_rewards.dtype), 0.0)
    return token_rewards.scatter_add(1, last[:, None], bonus[:, None])


class FixedKLController:
    """A constant KL coefficient `value`; same interface as AdaptiveKLController."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        """{"value": the current coefficient}, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient saved by `state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered toward a target KL (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    update: e = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon.
    current_kl is the measured KL of the last batch; n_steps the samples (or steps) it covered.
    """

    def __init__(self, init_kl_coef: float, *, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target > 0 and horizon > 0, got {target=}, {horizon=}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` toward the coefficient that keeps the KL at `target` (see the class docstring)."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """{"value": the current coefficient}, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the coefficient saved by `state_dict`."""
        self.value = float(state["value"])


def dynamic_sampling_keep(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO dynamic sampling filter (Yu et al. 2025): `[B]` bool, True where the sample's group has rewards that
    are not all equal (a group of equal rewards has zero GRPO advantage and no gradient). Size-1 groups: False.
    """
    _, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = sizes.numel()
    high = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=rewards.device)
    low = torch.full((n_groups,), torch.inf, dtype=torch.float64, device=rewards.device)
    r = rewards.double()
    high = high.scatter_reduce(0, index, r, reduce="amax")
    low = low.scatter_reduce(0, index, r, reduce="amin")
    return (high > low)[index]
