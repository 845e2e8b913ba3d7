"""Policy, value, preference and SFT losses against hand-computed values."""

import math

import pytest
import torch

from megarl.algo.losses import dpo_loss, gspo_loss, ppo_clip_loss, rollout_rejection_mask, sft_loss, value_loss

LN = math.log


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_ppo_on_policy_ratio_one_no_clip_no_kl_loss_is_minus_advantage():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=gen) * 3
    logprobs = old.clone().requires_grad_(True)
    advantages = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    loss, stats = ppo_clip_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    valid = mask.bool()
    close(loss, torch.where(valid, -advantages, 0.0))
    close(stats["ratio"], valid.float())
    close(stats["clipped"], torch.zeros(3, 5))
    close(stats["approx_kl"], torch.zeros(3, 5))
    loss.sum().backward()
    close(logprobs.grad, torch.where(valid, -advantages, 0.0))  # d(-A * ratio)/d logp = -A at ratio 1


def test_ppo_clipping_with_clip_higher():
    # clip range [1 - .2, 1 + .28] = [0.8, 1.28]
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1, 1.25]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0, 1.0]])
    logprobs = torch.log(ratio).requires_grad_(True)
    loss, stats = ppo_clip_loss(logprobs, torch.zeros(1, 6), adv, torch.ones(1, 6), clip_low=0.2, clip_high=0.28)
    # 1: A>0, r>1.28: max(-1.5, -1.28) = -1.28 clipped   2: A>0, r<.8: max(-.5, -.8) = -.5 not clipped
    # 3: A<0, r<.8: max(.5, .8) = .8 clipped              4: A<0, r>1.28: max(1.5, 1.28) = 1.5 not clipped
    # 5: inside: -2.2                                     6: r = 1.25 is inside only thanks to clip-higher
    close(loss, [[-1.28, -0.5, 0.8, 1.5, -2.2, -1.25]])
    close(stats["clipped"], [[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    loss.sum().backward()
    # unclipped tokens: d(-A r)/d logp = -A r; clipped tokens: 0
    close(logprobs.grad, [[0.0, -0.5, 0.0, 1.5, -2.2, -1.25]])
    # k3 of KL(new || old) with d = old - new = -ln r: e^d - d - 1 = 1/r + ln r - 1
    # for r = 1.5: .6666667 + .4054651 - 1 = .0721318
    assert stats["approx_kl"][0, 0].item() == pytest.approx(0.0721318, abs=1e-6)


def test_ppo_dual_clip_caps_negative_advantage_loss():
    ratio = torch.tensor([[4.0, 2.0, 4.0, 0.5]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    logprobs = torch.log(ratio).requires_grad_(True)
    loss, stats = ppo_clip_loss(
        logprobs, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    # 1: A<0, loss 4 > cap -3 * A = 3 -> 3 (clipped)      2: loss 2 < 3 -> 2 (not clipped)
    # 3: A>0: ordinary clip -> -1.28 (clipped)            4: A<0, r<.8: ordinary clip -> .8 (clipped)
    close(loss, [[3.0, 2.0, -1.28, 0.8]])
    close(stats["clipped"], [[1.0, 0.0, 1.0, 1.0]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, 2.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logprobs, torch.zeros(1, 4), adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.2, dual_clip=1.0)


def test_ppo_truncated_importance_sampling_weight():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[LN(2.0), LN(0.5), 0.0]])  # exp(old - rollout) = [2, .5, 1]
    logprobs = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    loss, stats = ppo_clip_loss(
        logprobs, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2, rollout_logprobs=rollout, tis_cap=1.5
    )
    # weights min([2, .5, 1], 1.5) = [1.5, .5, 1]; on-policy loss -A -> [-1.5, -.5, 2]
    close(loss, [[-1.5, -0.5, 2.0]])
    close(stats["tis_weight"], [[1.5, 0.5, 1.0]])
    loss.sum().backward()
    close(logprobs.grad, [[-1.5, -0.5, 2.0]])  # the weight is detached: it scales, never receives gradient
    with pytest.raises(ValueError, match="rollout_logprobs"):
        ppo_clip_loss(logprobs, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2, tis_cap=1.5)


def test_ppo_tis_weight_is_zero_where_the_rollout_logprob_is_not_finite():
    # NaN or +-inf is a broken rollout logprob, not a probability: weight 0 (no loss, no gradient), not NaN or cap
    old = torch.full((1, 4), -1.0)
    rollout = torch.tensor([[math.nan, math.inf, -math.inf, -1.0 - LN(1.5)]])  # the last: ratio 1.5
    logprobs = old.clone().requires_grad_(True)
    loss, stats = ppo_clip_loss(logprobs, old, torch.ones(1, 4), torch.ones(1, 4), clip_low=0.2, clip_high=0.2,
                                rollout_logprobs=rollout, tis_cap=2.0)
    close(stats["tis_weight"], [[0.0, 0.0, 0.0, 1.5]])
    close(loss, [[0.0, 0.0, 0.0, -1.5]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, 0.0, 0.0, -1.5]])


def test_ppo_padding_with_extreme_logprobs_stays_finite():
    logprobs = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1000.0]])  # exp(1000) would overflow on the padded token
    loss, stats = ppo_clip_loss(logprobs, old, torch.ones(1, 2), torch.tensor([[1, 0]]), clip_low=0.2, clip_high=0.2)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()
    close(loss, [[-1.0, 0.0]])


def test_rollout_rejection_mask_token_level_band_is_inclusive():
    # band [0.5, 2]; ratios r = exp(old - rollout) with rollout = 0, so old is ln r to the last bit, exactly
    # what the band edges ln 0.5 and ln 2 round to: the edges are kept, a ratio 0.1% beyond either is rejected
    ratios = [0.25, 0.5 * 0.999, 0.5, 1.0, 2.0, 2.0 * 1.001, 4.0]
    old = torch.tensor([[LN(r) for r in ratios] + [100.0]])  # last column: padding with a huge ratio
    rollout = torch.tensor([[0.0] * len(ratios) + [-100.0]])
    mask = torch.tensor([[1] * len(ratios) + [0]])
    keep = rollout_rejection_mask(old, rollout, mask, low=0.5, high=2.0, level="token")
    # 0.25 out, 0.4995 out, 0.5 edge in, 1 in, 2 edge in, 2.002 out, 4 out; padding is never kept
    assert torch.equal(keep, torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]]))


def test_rollout_rejection_mask_sequence_level_uses_the_geometric_mean():
    # band [0.5, 2]; two response tokens per row (+ padding in the last row), ratios r = exp(old - rollout)
    ratios = [[4.0, 1.0],     # geometric mean sqrt(4 * 1) = 2: the upper edge, kept (token level rejects the 4)
              [4.0, 2.0],     # sqrt(8) = 2.83 > 2: the whole row rejected, its in-band 2 too
              [0.25, 1.0],    # sqrt(.25) = .5: the lower edge, kept
              [0.25, 0.5],    # sqrt(.125) = .354 < .5: rejected
              [1.0, 1.0]]     # 1, kept; its padding (ratio e^200) must not enter the mean, which would be e^100
    old = torch.tensor([[LN(r) for r in row] + [0.0] for row in ratios])
    old[4, 2] = 100.0
    rollout = torch.zeros(5, 3)
    rollout[4, 2] = -100.0
    mask = torch.tensor([[1, 1, 0]] * 5)
    keep = rollout_rejection_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence")
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0],
                                           [1.0, 1.0, 0.0]]))
    # the same ratios judged token by token: 4 and .25 leave the band, 2 and .5 sit on its edges
    keep = rollout_rejection_mask(old, rollout, mask, low=0.5, high=2.0, level="token")
    assert torch.equal(keep, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0],
                                           [1.0, 1.0, 0.0]]))


def test_rollout_rejection_mask_refuses_a_band_without_one_inside():
    ones = torch.ones(1, 2)
    for low, high in ((1.0, 2.0), (0.5, 1.0), (0.0, 2.0)):
        with pytest.raises(ValueError, match="0 < low < 1 < high"):
            rollout_rejection_mask(ones, ones, ones, low=low, high=high, level="token")
    with pytest.raises(ValueError, match="'tokens'"):
        rollout_rejection_mask(ones, ones, ones, low=0.5, high=2.0, level="tokens")


def test_gspo_hand_computed_sequence_ratio():
    # valid log-ratios [.1, .3] -> mean .2, s = e^.2 = 1.2214028 (inside [.8, 1.28]); the padded token is ignored
    logprobs = torch.tensor([[0.1, 0.3, 50.0]], requires_grad=True)
    loss, stats = gspo_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1, 1, 0]]),
                            clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.2214028, -1.2214028, 0.0]])
    close(stats["ratio"], [[1.2214028, 1.2214028, 0.0]])
    close(stats["clipped"], [[0.0, 0.0, 0.0]])
    loss.sum().backward()
    # token-level straight-through: d/d logp_t of sg(s) * exp(logp_t - sg(logp_t)) = s, times -A
    close(logprobs.grad, [[-1.2214028, -1.2214028, 0.0]])


def test_gspo_token_past_the_token_bound_passes_no_gradient():
    # log-ratios +-25 are clamped to +-20 (as PPO's): the sequence mean is 0, s = 1 inside the clip range, and
    # neither token passes a gradient; the third, inside the bound, passes -A * s = -1
    logprobs = torch.tensor([[25.0, -25.0, 0.0]], requires_grad=True)
    loss, stats = gspo_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3),
                            clip_low=0.2, clip_high=0.28)
    close(stats["ratio"], [[1.0, 1.0, 1.0]])
    loss.sum().backward()
    close(logprobs.grad, [[0.0, 0.0, -1.0]])


def test_gspo_equals_ppo_when_every_token_has_the_same_log_ratio():
    log_ratio = torch.tensor([LN(1.5), LN(0.9), LN(0.5), LN(1.1)])  # clipped, inside, clipped, inside
    adv_seq = torch.tensor([1.0, -1.0, -1.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    old = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    new = (old + log_ratio[:, None]).detach()

    a = new.clone().requires_grad_(True)
    gspo, gspo_stats = gspo_loss(a, old, adv_seq, mask, clip_low=0.2, clip_high=0.28)
    gspo.sum().backward()
    b = new.clone().requires_grad_(True)
    ppo, ppo_stats = ppo_clip_loss(b, old, adv_seq[:, None].expand(4, 4), mask, clip_low=0.2, clip_high=0.28)
    ppo.sum().backward()

    close(gspo, ppo)
    close(a.grad, b.grad)
    for key in ("clipped", "ratio", "approx_kl"):
        close(gspo_stats[key], ppo_stats[key])
    close(gspo_stats["clipped"][:, 0], [1.0, 0.0, 1.0, 0.0])


def test_value_loss_clipping():
    values = torch.tensor([[1.0, 0.6, 1.0, 3.0]])
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    # 1: .5*(1-2)^2 = .5 vs clipped v .7: .5*1.3^2 = .845 -> .845 (clipped)
    # 2: v .6 inside [.3, .7]: .5*.36 = .18   3: .5*1 = .5 vs .5*.49 = .245 -> .5   4: masked
    close(loss, [[0.845, 0.18, 0.5, 0.0]])
    close(stats["vf_clipped"], [[1.0, 0.0, 0.0, 0.0]])
    loss, _ = value_loss(values, old, returns, mask, clip=None)
    close(loss, [[0.5, 0.18, 0.5, 0.0]])


def test_dpo_sigmoid_and_ipo():
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    # pair 0: chosen log-ratio 1, rejected -1, h = 2; pair 1: h = -2; beta .1 -> beta*h = +-.2
    # -logsigmoid(.2) = ln(1 + e^-.2) = 0.5981389; -logsigmoid(-.2) = ln(1 + e^.2) = 0.7981389
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.1)
    close(loss, [0.5981389, 0.7981389])
    close(stats["chosen_rewards"], [0.1, -0.1])
    close(stats["rejected_rewards"], [-0.1, 0.1])
    close(stats["reward_accuracy"], [1.0, 0.0])
    # label smoothing .1: .9 * .5981389 + .1 * .7981389 = .6181389 (and symmetric for pair 1: .7781389)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    close(loss, [0.6181389, 0.7781389])
    # IPO: (h - 1/(2*.1))^2 = (2 - 5)^2 = 9, (-2 - 5)^2 = 49
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="ipo")
    close(loss, [9.0, 49.0])
    with pytest.raises(ValueError, match="sigmoid, ipo"):
        dpo_loss(pc, pr, rc, rr, beta=0.1, kind="hinge")


def test_sft_loss_is_masked_nll():
    close(sft_loss(torch.tensor([[-0.5, -2.0, -9.0]]), torch.tensor([[1, 1, 0]])), [[0.5, 2.0, 0.0]])
