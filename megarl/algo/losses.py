"""Policy, value, preference, reward-model and SFT losses.

Token losses are returned per token, `[B, T]`, 0 on masked tokens; the caller reduces them with
`megarl.algo.aggregate.aggregate`, which owns every denominator. Stats are detached, per token (or per pair),
0 on masked tokens, for the caller to aggregate the same way (e.g. clip fraction = token-mean of "clipped").
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from megarl.algo.aggregate import masked_mean
from megarl.algo.kl import kl_estimate

DPO_KINDS = ("sigmoid", "ipo")
# Bounds on log importance ratios before exp: one token whose logprob moved by hundreds of nats (a numeric
# blow-up, or a rollout engine that sampled a token the trainer gives ~0 probability) would otherwise make
# the ratio inf and the loss NaN. Beyond e^20 the clip has long zeroed the gradient (or the dual clip capped
# the loss), so the bound changes nothing a finite step can see. GSPO's sequence ratio is a mean over
# tokens and is bounded tighter, above only: e^10 is already far outside any clip range.
MAX_TOKEN_LOG_RATIO = 20.0
MAX_SEQ_LOG_RATIO = 10.0


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate -min(r*A, clip(r, 1-low, 1+high)*A) and where the clipped branch won."""
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got {clip_low=}, {clip_high=}")
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # strictly greater: a tie (ratio inside the range, or A = 0) keeps the unclipped gradient
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _approx_kl(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """k3 estimate of KL(new || old) per token from the (bounded) log-ratio log(new / old) `[B, T]`."""
    return kl_estimate(log_ratio, torch.zeros_like(log_ratio), kind="k3", mask=valid)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clipped surrogate loss (Schulman et al. 2017).

    logprobs: `[B, T]` current policy (with grad); old_logprobs: `[B, T]` policy that scored the advantages;
    advantages, mask: `[B, T]`. ratio = exp(logprobs - old_logprobs).
    loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)); separate low/high ranges are DAPO's
    clip-higher (Yu et al. 2025).
    dual_clip (> 1, Ye et al. 2020): for A < 0 the loss is also capped at -dual_clip * A.
    tis_cap with rollout_logprobs `[B, T]` (truncated importance sampling, Yao et al. 2025): the loss is
    multiplied by the detached weight min(exp(old_logprobs - rollout_logprobs), tis_cap), correcting for the
    rollout engine sampling from a slightly different distribution than the trainer computes. Where that
    log-ratio is not finite (a rollout logprob that is NaN or +-inf is a broken value, not a probability) the
    weight is 0: the token adds no loss and no gradient, as a rejected one, and still counts in the denominators.
    Returns (loss `[B, T]`, stats): "clipped" 1.0 where clipping (either bound or dual-clip) zeroed the
    gradient, "ratio", "approx_kl" (k3 estimate of KL(new || old)), plus "tis_weight" when TIS is on.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if tis_cap is not None and rollout_logprobs is None:
        raise ValueError("tis_cap needs rollout_logprobs")
    valid = mask.bool()
    # padding may hold arbitrary logprobs; zero the log-ratio there so exp cannot overflow into the graph
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).clamp(-MAX_TOKEN_LOG_RATIO, MAX_TOKEN_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_low=clip_low, clip_high=clip_high)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped = clipped | dual
    stats = {}
    if tis_cap is not None:
        # exp may overflow to inf; the cap brings it back. NaN passes the cap, and a rejected token's zero upstream
        # gradient times NaN is NaN: so the weight is in [0, tis_cap] everywhere (and detached).
        log_weight = torch.where(valid, old_logprobs - rollout_logprobs, 0.0).detach()
        weight = torch.where(log_weight.isfinite(), log_weight.exp().clamp(max=tis_cap), 0.0)
        loss = loss * weight
        stats["tis_weight"] = torch.where(valid, weight, 0.0)
    stats["clipped"] = (clipped & valid).to(loss.dtype)
    stats["ratio"] = torch.where(valid, ratio.detach(), 0.0)
    stats["approx_kl"] = _approx_kl(log_ratio.detach(), valid)
    return torch.where(valid, loss, 0.0), stats


def rollout_rejection_mask(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    low: float,
    high: float,
    level: str,
) -> Tensor:
    """Which response tokens an off-policy correction keeps: 1.0 where kept, 0.0 where rejected or not a
    response token, `[B, T]`.

    old_logprobs, rollout_logprobs, mask: `[B, T]`. r = exp(old_logprobs - rollout_logprobs), the trainer's
    probability of each sampled token over the rollout engine's. The band [low, high] is inclusive and is
    compared in log space (log low <= log r <= log high), so r never overflows and a ratio exactly at an edge
    is kept; a ratio that is not finite (a rollout logprob that is NaN or +-inf) is rejected.
      "token": each token whose r leaves the band is rejected (IcePop, Zhao et al. 2025).
      "sequence": the geometric mean of r over the sequence's response tokens, exp(mean of log r), denominator
                  = response tokens of that sequence; a sequence whose mean leaves the band is rejected whole
                  (sequence-level masked importance sampling).
    """
    if not 0 < low < 1 < high:
        raise ValueError(f"the band must satisfy 0 < low < 1 < high, got {low=}, {high=}")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown rejection level {level!r}; expected 'token' or 'sequence'")
    valid = mask.bool()
    # padding may hold arbitrary logprobs; it must not reach a sequence's mean
    log_ratio = torch.where(valid, old_logprobs - rollout_logprobs, 0.0).detach()
    if level == "sequence":
        log_ratio = masked_mean(log_ratio, valid, dim=-1)[:, None].expand_as(log_ratio)
    inside = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    return (inside & valid).to(old_logprobs.dtype)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages_seq: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GSPO loss with a sequence-level importance ratio (Zheng et al. 2025, GSPO-token form).

    logprobs, old_logprobs, mask: `[B, T]`; advantages_seq: `[B]`.
    s_i = exp(mean over valid tokens of (logprobs - old_logprobs)), denominator = valid tokens of sequence i.
    s_i,t = sg(s_i) * exp(d_t - sg(d_t)), d_t = logprobs - old_logprobs: its value is s_i on every token and its
    gradient is per token; loss_t = max(-A_i * s_i,t, -A_i * clip(s_i,t, 1 - clip_low, 1 + clip_high)).
    Aggregate with "seq-mean-token-mean" to get GSPO's objective and gradient exactly.
    Bounds, as PPO's: each d_t is clamped to +-MAX_TOKEN_LOG_RATIO and such a token passes no gradient; a
    sequence whose mean log-ratio passes MAX_SEQ_LOG_RATIO has s_i = e^MAX_SEQ_LOG_RATIO and passes no gradient
    from any token, whatever the sign of A_i.
    Returns (loss `[B, T]`, stats): "clipped", "ratio" (s_i on each valid token), "approx_kl" (k3, per token).
    """
    valid = mask.bool()
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).clamp(-MAX_TOKEN_LOG_RATIO, MAX_TOKEN_LOG_RATIO)
    seq_log_ratio = masked_mean(log_ratio, valid, dim=-1).detach()  # [B]
    # d_t - sg(d_t) is 0 in value and carries d_t's gradient, which the clamp above cuts past the token bound and
    # `within` past the sequence bound (s_i is capped there, but a gradient of s_i per token would still flow)
    within = (seq_log_ratio <= MAX_SEQ_LOG_RATIO)[:, None]
    grad_carrier = torch.where(within, log_ratio - log_ratio.detach(), 0.0)  # [B, T]
    token_ratio = torch.exp(seq_log_ratio.clamp(max=MAX_SEQ_LOG_RATIO)[:, None] + grad_carrier)  # [B, T]
    advantages = advantages_seq[:, None].to(token_ratio.dtype)
    loss, clipped = _clipped_surrogate(token_ratio, advantages, clip_low=clip_low, clip_high=clip_high)
    stats = {
        "clipped": (clipped & valid).to(loss.dtype),
        "ratio": torch.where(valid, token_ratio.detach(), 0.0),
        "approx_kl": _approx_kl(log_ratio.detach(), valid),
    }
    return torch.where(valid, loss, 0.0), stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped value loss (PPO2 baselines; Schulman et al. 2017).

    values: `[B, T]` current critic (with grad); old_values, returns, mask: `[B, T]`.
    loss = 0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2); clip=None: 0.5 * (v - R)^2.
    Returns (loss `[B, T]`, stats): "vf_clipped" 1.0 where the clipped term was strictly larger.
    """
    valid = mask.bool()
    loss = 0.5 * (values - returns).square()
    vf_clipped = torch.zeros_like(valid)
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped_loss = 0.5 * (clipped_values - returns).square()
        vf_clipped = clipped_loss > loss
        loss = torch.maximum(loss, clipped_loss)
    stats = {"vf_clipped": (vf_clipped & valid).to(loss.dtype)}
    return torch.where(valid, loss, 0.0), stats


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair preference loss. All inputs `[B]`: summed response logprobs of each pair.

    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected).
      "sigmoid" (DPO, Rafailov et al. 2023): -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h),
                eps = label_smoothing (conservative DPO; 0 gives plain DPO).
      "ipo" (Azar et al. 2023): (h - 1 / (2 * beta))^2; label_smoothing must be 0.
    Returns (loss `[B]`, stats `[B]`): "chosen_rewards" = beta * (policy_chosen - ref_chosen),
    "rejected_rewards" likewise, "reward_accuracy" = 1.0 where chosen_rewards > rejected_rewards.
    """
    if kind not in DPO_KINDS:
        raise ValueError(f"unknown DPO loss kind {kind!r}; expected one of {', '.join(DPO_KINDS)}")
    if kind == "ipo" and label_smoothing != 0.0:
        raise ValueError("label_smoothing applies to the 'sigmoid' DPO loss only")
    chosen = policy_chosen_logps - ref_chosen_logps
    rejected = policy_rejected_logps - ref_rejected_logps
    h = chosen - rejected
    if kind == "sigmoid":
        loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        loss = (h - 1.0 / (2.0 * beta)).square()
    chosen_rewards = beta * chosen.detach()
    rejected_rewards = beta * rejected.detach()
    stats = {
        "chosen_rewards": chosen_rewards,
        "rejected_rewards": rejected_rewards,
        "reward_accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
    }
    return loss, stats


def bradley_terry_loss(chosen_scores: Tensor, rejected_scores: Tensor, *,
                       center_coef: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair reward-model loss. Inputs `[B]`: the scalar head's score of each pair's chosen and rejected
    sequence.

    loss = -logsigmoid(chosen - rejected) (Bradley-Terry, as in Ouyang et al. 2022)
           + center_coef * (chosen + rejected)^2 (keeps scores centred on 0, Eisenstein et al. 2023).
    Returns (loss `[B]`, stats `[B]`, detached): "accuracy" = 1.0 where chosen > rejected, 0.5 on a tie (so
    an untrained head that scores everything alike sits at chance, 0.5), "margin" = chosen - rejected.
    """
    margin = chosen_scores - rejected_scores
    loss = -F.logsigmoid(margin)
    if center_coef:
        loss = loss + center_coef * (chosen_scores + rejected_scores).square()
    margin = margin.detach()
    accuracy = (margin > 0).to(margin.dtype) + 0.5 * (margin == 0).to(margin.dtype)
    return loss, {"accuracy": accuracy, "margin": margin}


def sft_loss(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token negative log-likelihood: logprobs, mask `[B, T]` -> `[B, T]` = -logprobs, 0 on masked tokens."""
    return torch.where(mask.bool(), -logprobs, 0.0)
