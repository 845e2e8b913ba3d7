"""Per-token KL estimators and entropy."""

import torch
from torch import Tensor

KL_KINDS = ("k1", "k2", "k3")
# k3 exponentiates the log-ratio: bounded to +-20 nats first (e^20 ~ 5e8), so one token the two policies
# disagree on by hundreds of nats gives a large finite KL and no gradient, not inf and a NaN loss.
MAX_K3_LOG_RATIO = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, *, kind: str, mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL divergence").

    logprobs, ref_logprobs: `[B, T]` log-probabilities of the sampled tokens under pi and pi_ref.
    Returns `[B, T]`, no reduction (the caller aggregates). With d = ref_logprobs - logprobs:
      "k1": -d                      unbiased, can be negative
      "k2": 0.5 * d**2              biased, low variance, always >= 0
      "k3": exp(d) - d - 1          unbiased, always >= 0; d clamped to +-MAX_K3_LOG_RATIO
    mask `[B, T]`: positions where it is 0 (prompt, padding) get d = 0, so their estimate is 0 and their
    gradient is exactly 0. Masking the result afterwards is not enough: k3 overflows where d > ~88.7 (fp32)
    and the masked gradient is then 0 * inf = NaN.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
    log_ratio = ref_logprobs - logprobs
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    # expm1 keeps k3 accurate when the policies are close and d is tiny
    log_ratio = log_ratio.clamp(-MAX_K3_LOG_RATIO, MAX_K3_LOG_RATIO)
    return torch.expm1(log_ratio) - log_ratio


def reverse_kl(logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse KL of on-policy distillation, log p_student(y_t) - log p_teacher(y_t), on tokens y_t
    sampled from the student: a single-sample (k1) estimate of KL(student || teacher) at each position
    (Agarwal et al. 2024, GKD; Gu et al. 2024, MiniLLM). logprobs, teacher_logprobs, mask: `[B, T]`.
    Returns `[B, T]`, 0 where mask is 0, no reduction."""
    return torch.where(mask.bool(), logprobs - teacher_logprobs, 0.0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy -sum_v p_v log p_v of softmax(logits) over the last dim.

    logits: `[..., V]` -> `[...]`, in the dtype of `logits` (upcast before calling for bf16 inputs).
    Stable for large logits (log_softmax) and for -inf logits (masked vocabulary padding): those are
    clamped to the dtype's lowest finite value so 0 * log 0 gives 0 instead of NaN, in value and gradient.
    """
    logits = logits.clamp(min=torch.finfo(logits.dtype).min)
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
