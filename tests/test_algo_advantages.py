"""Advantage estimators and reward shaping against hand-computed values."""

import math

import pytest
import torch

from megarl.algo.advantages import (
    AdaptiveKLController,
    FixedKLController,
    broadcast_to_tokens,
    dynamic_sampling_keep,
    gae,
    grpo_advantages,
    kl_penalized_token_rewards,
    reinforce_baseline_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    whiten,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_grpo_one_group_uses_unbiased_std():
    # rewards [1,0,0,1]: mean .5, deviations +-.5, sum of squares 1, unbiased var 1/3, std 0.5773503
    # -> +-0.5 / 0.5773503 = +-0.8660254 (eps=1e-6 moves the 6th decimal at most)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([7, 7, 7, 7]))
    close(adv, [0.8660254, -0.8660254, -0.8660254, 0.8660254])


def test_grpo_non_contiguous_groups_of_different_sizes():
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0, 5.0])
    group_ids = torch.tensor([0, 1, 0, 1, 1, 9])
    # group 0 = [1, 3]: mean 2, unbiased std sqrt(2/1) = 1.4142136 -> -0.7071068, +0.7071068
    # group 1 = [2, 0, 4]: mean 2, unbiased std sqrt(8/2) = 2 -> 0, -1, +1
    # group 9 = [5]: size 1 -> 0
    close(grpo_advantages(rewards, group_ids), [-0.7071068, 0.0, 0.7071068, -1.0, 1.0, 0.0])
    # Dr. GRPO: mean-centering only
    close(grpo_advantages(rewards, group_ids, std_norm=False), [-1.0, 0.0, 1.0, -2.0, 2.0, 0.0])


def test_grpo_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    close(adv, [0.0, 0.0, 0.0])


def test_rloo_leave_one_out():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 3.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    # group 0: sum 2, n 4 -> r_i - (2 - r_i)/3: 1 - 1/3 = 0.6666667, 0 - 2/3 = -0.6666667
    # group 1: [2, 4] -> 2 - 4 = -2, 4 - 2 = 2; group 2: size 1 -> 0
    close(rloo_advantages(rewards, group_ids), [2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 0.0])


def test_reinforce_pp_returns_discounts_over_valid_tokens():
    r = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 2.0, 9.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    # row 0 (right padding, reward 5 on padding ignored): G = [0.81, 0.9, 1, 0] for gamma 0.9
    # row 1 (token 1 masked: its reward 2 ignored and no discount step): G3 = 1, G2 = 9 + .9 = 9.9,
    #   G1 = 0 (masked), G0 = 0 + .9 * 9.9 = 8.91
    close(reinforce_pp_returns(r, mask, gamma=0.9), [[0.81, 0.9, 1.0, 0.0], [8.91, 0.0, 9.9, 1.0]])
    close(reinforce_pp_returns(r, mask), [[1.0, 1.0, 1.0, 0.0], [10.0, 0.0, 10.0, 1.0]])


def test_whiten_masked_population_statistics():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # valid values 1, 3, 5, 7: mean 4, population var (9+1+1+9)/4 = 5, std 2.2360680
    out = whiten(values, mask)
    close(out, [[-1.3416408, -0.4472136, 0.0], [0.4472136, 1.3416408, 0.0]])
    # shift_mean=False keeps the mean: + 4
    close(whiten(values, mask, shift_mean=False), [[2.6583592, 3.5527864, 0.0], [4.4472136, 5.3416408, 0.0]])


def test_reinforce_pp_advantages_whiten_the_returns():
    r = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    mask = torch.ones(2, 2)
    # returns (gamma 1) = [[1,1],[3,3]]: mean 2, population std 1 -> [[-1,-1],[1,1]]
    close(reinforce_pp_advantages(r, mask), [[-1.0, -1.0], [1.0, 1.0]])


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    # centered per group: [-1, 1, 0, 0]; tokens: -1, -1 | 1 | 0, 0, 0 (row 3 has none)
    # token mean -1/6, population var = (2*(5/6)^2 + (7/6)^2 + 3*(1/6)^2)/6 = (50+49+3)/216 = 0.4722222
    # std 0.6871843: -1 -> (-5/6)/std = -1.2126781, 1 -> (7/6)/std = 1.6977494, 0 -> (1/6)/std = 0.2425356
    out = reinforce_pp_baseline_advantages(rewards, group_ids, mask)
    close(
        out,
        [[-1.2126781, -1.2126781, 0.0], [1.6977494, 0.0, 0.0], [0.2425356, 0.2425356, 0.2425356], [0.0, 0.0, 0.0]],
    )


def test_reinforce_baseline():
    close(reinforce_baseline_advantages(torch.tensor([1.0, 0.5]), torch.tensor([0.25, 0.5])), [0.75, 0.0])
    close(reinforce_baseline_advantages(torch.tensor([1.0, 0.5]), 0.5), [0.5, 0.0])


def test_gae_hand_computed_and_right_padding_is_terminal():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = [0.5, 0.4, 0.3]; returns = 1 everywhere
    adv, ret = gae(r, v, mask, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])
    # gamma .9, lam .8: deltas d2 = 1 - .7 = .3, d1 = .9*.7 - .6 = .03, d0 = .9*.6 - .5 = .04
    # A2 = .3, A1 = .03 + .72*.3 = .246, A0 = .04 + .72*.246 = .21712; returns = A + V
    expected_adv = [[0.21712, 0.246, 0.3]]
    expected_ret = [[0.71712, 0.846, 1.0]]
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    close(adv, expected_adv)
    close(ret, expected_ret)
    # right padding with garbage values/rewards: same numbers, zeros on padding (V after the end is 0)
    adv, ret = gae(
        torch.tensor([[0.0, 0.0, 1.0, 7.0, 7.0]]),
        torch.tensor([[0.5, 0.6, 0.7, 9.0, 9.0]]),
        torch.tensor([[1, 1, 1, 0, 0]]),
        gamma=0.9,
        lam=0.8,
    )
    close(adv, [[0.21712, 0.246, 0.3, 0.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0, 0.0]])


def test_gae_skips_masked_tokens_inside_a_response():
    # the masked middle token (an env/tool token) is skipped: same as the compressed sequence [0.5, 0.6, 0.7]
    adv, ret = gae(
        torch.tensor([[0.0, 3.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 9.0, 0.6, 0.7]]),
        torch.tensor([[1, 0, 1, 1]]),
        gamma=0.9,
        lam=0.8,
    )
    close(adv, [[0.21712, 0.0, 0.246, 0.3]])
    close(ret, [[0.71712, 0.0, 0.846, 1.0]])


def test_broadcast_to_tokens():
    close(broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]])), [[2, 2, 0], [-1, 0, 0]])


def test_kl_penalized_token_rewards_reward_on_last_valid_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    out = kl_penalized_token_rewards(torch.tensor([1.0, 2.0, 3.0]), kl, mask, kl_coef=0.5)
    # row 0: -.05, -.1 + 1 = .9, 0 (masked); row 1: -.25, -.25, -.25 + 2; row 2: nothing valid -> zeros
    close(out, [[-0.05, 0.9, 0.0], [-0.25, -0.25, 1.75], [0.0, 0.0, 0.0]])


def test_adaptive_kl_controller_and_checkpoint():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # kl 9: error 9/6 - 1 = .5 clipped to .2 -> value * (1 + .2 * 256 / 10000) = .1 * 1.00512
    ctl.update(9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.100512)
    ctl.update(6.0, n_steps=256)  # on target: unchanged
    assert ctl.value == pytest.approx(0.100512)
    # kl 5: error -1/6 (inside the clip) -> * (1 - 256 / 60000)
    ctl.update(torch.tensor(5.0), n_steps=256)
    assert ctl.value == pytest.approx(0.100512 * (1 - 256 / 60000))
    other = AdaptiveKLController(1.0, target=6.0, horizon=10000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value

    fixed = FixedKLController(0.05)
    fixed.update(100.0, n_steps=10)
    assert fixed.value == 0.05
    restored = FixedKLController(0.0)
    restored.load_state_dict(fixed.state_dict())
    assert restored.value == 0.05


def test_dynamic_sampling_keeps_groups_with_reward_variance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    group_ids = torch.tensor([0, 0, 1, 1, 1, 2, 3])
    # group 0 all 1 -> drop; group 1 has 0 and 1 -> keep; groups 2, 3 size 1 -> drop
    keep = dynamic_sampling_keep(rewards, group_ids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, True, False, False]


def test_integer_rewards_are_accepted():
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), std_norm=False)
    assert adv.is_floating_point() and math.isclose(adv[0].item(), 0.5)


# ---- equal rewards: exactly zero ------------------------------------------------------------------------------
# A group whose rewards are all equal must get an advantage of exactly 0: the trainer skips such samples
# (`zero_advantage_split` tests `!= 0`), and anything else is a direction made of rounding error, which
# GRPO's std division blows up (eight float32 rewards of 0.1 gave -0.0074 on each).
EQUAL_REWARDS = [0.1, 0.2, 0.3, 0.7, 0.9, 1 / 3, 1.1, 0.0, 1.0, 0.5]
GROUP_SIZES = range(2, 17)


def random_lengths_mask(n: int, *, seed: int, width: int = 12) -> torch.Tensor:
    """`[n, width]` right-padded response masks of random lengths 1..width."""
    lengths = torch.randint(1, width + 1, (n,), generator=torch.Generator().manual_seed(seed))
    return (torch.arange(width) < lengths[:, None]).float()


ESTIMATORS = {  # (rewards [n], group_ids [n], mask [n, T]) -> advantages
    "grpo": lambda r, g, mask: grpo_advantages(r, g),
    "dr_grpo": lambda r, g, mask: grpo_advantages(r, g, std_norm=False),
    "rloo": lambda r, g, mask: rloo_advantages(r, g),
    "reinforce_pp_baseline": lambda r, g, mask: reinforce_pp_baseline_advantages(r, g, mask),
    "reinforce_pp": lambda r, g, mask: reinforce_pp_advantages(
        kl_penalized_token_rewards(r, torch.zeros_like(mask), mask, kl_coef=0.0), mask),
    "whiten": lambda r, g, mask: whiten(broadcast_to_tokens(r, mask), mask),
}


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_group_of_equal_float32_rewards_gets_exactly_zero_advantage(name):
    nonzero = []
    for value in EQUAL_REWARDS:
        for n in GROUP_SIZES:
            rewards = torch.full((n,), value, dtype=torch.float32)  # the batch's dtype
            adv = ESTIMATORS[name](rewards, torch.full((n,), 3), random_lengths_mask(n, seed=n))
            assert adv.dtype == torch.float32
            if (adv != 0).any():
                nonzero.append((round(value, 4), n, float(adv.abs().max())))
    assert not nonzero, f"{len(nonzero)} of 150 groups (value, size, max |A|): {nonzero[:6]}"


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_equal_groups_in_one_batch_get_exactly_zero_beside_groups_that_differ(name):
    # the 150 equal groups, interleaved, in one batch: each group's statistics are its own
    rewards = torch.tensor([v for v in EQUAL_REWARDS for n in GROUP_SIZES for _ in range(n)], dtype=torch.float32)
    group_ids = torch.tensor([g for g in range(150) for _ in range(list(GROUP_SIZES)[g % 15])])
    order = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(0))
    rewards, group_ids = rewards[order], group_ids[order]
    mask = random_lengths_mask(len(rewards), seed=1)
    adv = ESTIMATORS[name](rewards, group_ids, mask)
    assert torch.equal(adv, torch.zeros_like(adv)), f"{int((adv != 0).sum())} non-zero"
    if name != "reinforce_pp_baseline":  # whitening over the batch moves every group; the others are per group
        # a group that differs beside them gets its usual advantage, and theirs stay 0
        mixed = torch.cat([rewards, torch.tensor([0.1, 0.2])])
        adv = ESTIMATORS[name](mixed, torch.cat([group_ids, torch.tensor([999, 999])]), mask)
        assert torch.equal(adv[:-2], torch.zeros_like(rewards)) and (adv[-2:] != 0).all()


def test_equal_rewards_of_any_float_dtype_get_exactly_zero():
    # 0.1 + 0.1 + 0.1 != 3 * 0.1 in float64 too: exactness comes from the shift by the group's minimum
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        rewards = torch.full((3,), 0.1, dtype=dtype)
        group_ids = torch.zeros(3)
        for adv in (grpo_advantages(rewards, group_ids), grpo_advantages(rewards, group_ids, std_norm=False),
                    rloo_advantages(rewards, group_ids)):
            assert adv.dtype == dtype and torch.equal(adv, torch.zeros(3, dtype=dtype)), (dtype, adv)
