"""megarl.objective: how the recipe's algorithm reaches the math. Each `algo.name` gives the estimator and loss
of its paper, reward shaping and KL-in-reward land where they should, the loss reads only the batch fields
it declares, every KL term is taken on response tokens and aggregated like the recipe says, extreme
importance ratios stay finite, and the rollout batch keeps its rows aligned when dynamic sampling picks and
joins groups. Expected numbers are worked out by hand from the formulas.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

LN = math.log

from megarl.algo.aggregate import LossNorm, aggregate
from megarl.algo.losses import ppo_clip_loss
from megarl.batch import RolloutBatch
from megarl.config import AlgoConfig, load_config
from megarl.dataclass_yaml import ConfigError
from megarl.objective import advantage_fn, kl_controller, policy_objective


def make_batch(*, rewards, mask, old=None, ref=None, values=None, group_ids=None) -> RolloutBatch:
    mask = torch.tensor(mask, dtype=torch.float32)
    batch, width = mask.shape
    zeros = torch.zeros_like(mask)
    return RolloutBatch(
        tokens=torch.arange(batch * width).reshape(batch, width), response_mask=mask,
        prompt_lens=torch.ones(batch, dtype=torch.long),
        group_ids=torch.tensor(group_ids if group_ids is not None else [0] * batch),
        rollout_logprobs=zeros, responses=[f"r{i}" for i in range(batch)], answers=["a"] * batch,
        finish_reasons=["stop"] * batch, prompt_texts=["p"] * batch, metadata=[{}] * batch, rewards=torch.tensor(rewards, dtype=torch.float32),
        old_logprobs=torch.tensor(old) if old is not None else zeros,
        ref_logprobs=torch.tensor(ref) if ref is not None else None,
        values=torch.tensor(values) if values is not None else None,
    )


def close(actual, expected, tol=1e-5):
    expected = torch.tensor(expected, dtype=actual.dtype)
    assert torch.allclose(actual, expected, atol=tol), (actual, expected)


# ---- estimators --------------------------------------------------------------------------------------------
def test_ppo_folds_the_kl_into_token_rewards_then_gae_then_whitens():
    # one sequence, column 0 is the prompt; k1 KL = old - ref = [0, 0.5, 0]; kl_coef 0.1
    batch = make_batch(rewards=[1.0], mask=[[0, 1, 1]], old=[[0.0, -1.0, -2.0]], ref=[[0.0, -1.5, -2.0]],
                       values=[[0.0, 0.5, 0.2]])
    algo = AlgoConfig(name="ppo", kl_coef=0.1, kl_in_reward=True, kl_estimator="k1", gamma=1.0, lam=1.0)
    advantages, returns = advantage_fn(algo, group=None)(batch, 0.1)
    # token rewards [-, -0.05, 1.0]; gamma = lam = 1: A_2 = 1 - 0.2 = 0.8, A_1 = -0.05 + 1 - 0.5 = 0.45
    close(returns, [[0.0, 0.95, 1.0]])  # returns = A + V, before whitening
    close(advantages, [[0.0, -1.0, 1.0]], tol=1e-4)  # (A - 0.625) / 0.175


def test_ppo_kl_coef_comes_from_the_controller_at_call_time():
    batch = make_batch(rewards=[0.0], mask=[[0, 1, 1]], old=[[0.0, -1.0, -2.0]], ref=[[0.0, -1.5, -2.0]],
                       values=[[0.0, 0.0, 0.0]])
    algo = AlgoConfig(name="ppo", kl_coef=0.1, kl_in_reward=True, kl_estimator="k1", lam=1.0)
    estimate = advantage_fn(algo, group=None)
    _, with_kl = estimate(batch, 0.1)
    _, without = estimate(batch, 0.0)
    close(with_kl, [[0.0, -0.05, 0.0]])
    close(without, [[0.0, 0.0, 0.0]])


@pytest.mark.parametrize("name, expected", [
    ("grpo", [1.5, -0.5, -0.5, -0.5]),          # (r - 0.25) / 0.5, unbiased std of [1, 0, 0, 0]
    ("dapo", [1.5, -0.5, -0.5, -0.5]),
    ("gspo", [1.5, -0.5, -0.5, -0.5]),
    ("dr_grpo", [0.75, -0.25, -0.25, -0.25]),   # no std division
    ("rloo", [1.0, -1 / 3, -1 / 3, -1 / 3]),     # r_i - mean of the other three
])
def test_group_estimators_broadcast_sequence_advantages_to_response_tokens(name, expected):
    mask = [[0, 1, 1]] * 4
    batch = make_batch(rewards=[1.0, 0.0, 0.0, 0.0], mask=mask)
    advantages, returns = advantage_fn(AlgoConfig(name=name), group=None)(batch, 0.0)
    assert returns is None
    close(advantages, [[0.0, a, a] for a in expected], tol=1e-4)


def test_reinforce_pp_baseline_whitens_group_centered_rewards_over_tokens():
    batch = make_batch(rewards=[1.0, 0.0], mask=[[0, 1, 1], [0, 1, 1]])
    advantages, _ = advantage_fn(AlgoConfig(name="reinforce_pp_baseline"), group=None)(batch, 0.0)
    # centered [0.5, -0.5] on four tokens: mean 0, population std 0.5 -> [1, -1]
    close(advantages, [[0.0, 1.0, 1.0], [0.0, -1.0, -1.0]], tol=1e-4)


def test_adaptive_kl_controller_only_with_a_target():
    assert kl_controller(AlgoConfig(kl_coef=0.2)).value == 0.2
    adaptive = kl_controller(AlgoConfig(name="ppo", kl_coef=0.2, kl_in_reward=True, kl_target=1.0,
                                        kl_horizon=100))
    adaptive.update(2.0, 10)  # error clipped to +0.2: 0.2 * (1 + 0.2 * 10 / 100)
    assert adaptive.value == pytest.approx(0.204)


# ---- policy losses -----------------------------------------------------------------------------------------
def norm_of(mask: torch.Tensor) -> LossNorm:
    return LossNorm(tokens=float(mask.sum()), seqs=float(mask.shape[0]), max_len=mask.shape[1])


def test_gspo_clips_the_sequence_ratio_not_token_ratios():
    mask = torch.tensor([[1.0, 1.0]])
    old = torch.tensor([[0.0, 0.0]])
    # token ratios e^0.3 and e^-0.3: each is outside [0.8, 1.2], their sequence mean of logs is 0 (ratio 1)
    logprobs = torch.tensor([[0.3, -0.3]], requires_grad=True)
    mb = {"response_mask": mask, "old_logprobs": old, "advantages": torch.ones(1, 2)}
    _, ppo_stats = policy_objective(AlgoConfig(name="grpo"))(logprobs, mb, norm=norm_of(mask))
    gspo = policy_objective(AlgoConfig(name="gspo", loss_agg="seq-mean-token-mean"))
    _, gspo_stats = gspo(logprobs, mb, norm=norm_of(mask))
    assert ppo_stats["clipfrac"] == pytest.approx(0.5)  # the token with ratio e^0.3 > 1.2 and A > 0
    assert gspo_stats["clipfrac"] == 0.0
    assert gspo_stats["loss"] == pytest.approx(-1.0)  # -A * s with s = 1


def test_dual_clip_and_tis_reach_the_loss():
    mask = torch.tensor([[1.0]])
    mb = {"response_mask": mask, "old_logprobs": torch.tensor([[0.0]]), "advantages": torch.tensor([[-1.0]]),
          "rollout_logprobs": torch.tensor([[0.5]])}
    logprobs = torch.tensor([[2.0]], requires_grad=True)  # ratio e^2 = 7.39 with A < 0
    loss, _ = policy_objective(AlgoConfig())(logprobs, mb, norm=norm_of(mask))
    assert float(loss) == pytest.approx(7.389056, rel=1e-6)
    loss, _ = policy_objective(AlgoConfig(dual_clip=3.0))(logprobs, mb, norm=norm_of(mask))
    assert float(loss) == pytest.approx(3.0)  # capped at -c * A
    # TIS weight min(exp(old - rollout), cap) = exp(-0.5) = 0.6065 multiplies the dual-clipped loss
    loss, stats = policy_objective(AlgoConfig(dual_clip=3.0, tis_cap=2.0))(logprobs, mb, norm=norm_of(mask))
    assert float(loss) == pytest.approx(3.0 * 0.6065307, rel=1e-6)
    assert stats["tis_weight_mean"] == pytest.approx(0.6065307, rel=1e-6)


def mis_batch() -> dict[str, torch.Tensor]:
    """Three sequences (11 response tokens, row 1 padded) of random logprobs, with rollout ratios
    r = exp(old - rollout) chosen so that band [0.5, 2] rejects 7 tokens at token level and sequence 2 at
    sequence level."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    old = -torch.rand(3, 4, generator=gen) * 2
    ratios = torch.tensor([[1.0, 3.0, 1.0, 1.0],      # token 1 out; geometric mean 3^(1/4) = 1.32: row kept
                           [4.0, 0.25, 6.0, 1.0],     # 4, .25, 6 out; mean (4 * .25 * 6)^(1/3) = 1.82: kept
                           [0.3, 0.3, 0.3, 1.0]])     # .3 x3 out; mean .3^(3/4) = .405: row rejected
    rollout = old - torch.log(ratios)
    advantages = torch.randn(3, 4, generator=gen)
    return {"response_mask": mask, "old_logprobs": old, "advantages": advantages, "rollout_logprobs": rollout}


@pytest.mark.parametrize("level, rejected", [
    ("token", [[0, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]),
    ("sequence", [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_mis_zeroes_the_gradient_of_rejected_tokens_and_leaves_the_others_unscaled(level, rejected, loss_agg):
    mb = mis_batch()
    mask = mb["response_mask"]
    rejected = torch.tensor(rejected, dtype=torch.bool)
    # new logprobs near the old ones (log ratios within +-0.15: no clipping, every token has a gradient)
    new = (mb["old_logprobs"] + 0.05 * torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).detach()

    def grad_and_stats(algo: AlgoConfig):
        logprobs = new.clone().requires_grad_(True)
        loss, stats = policy_objective(algo)(logprobs, mb, norm=norm_of(mask))
        loss.backward()
        return logprobs.grad, stats

    plain, _ = grad_and_stats(AlgoConfig(loss_agg=loss_agg))
    masked, stats = grad_and_stats(AlgoConfig(loss_agg=loss_agg, mis_low=0.5, mis_high=2.0, mis_level=level))
    assert (plain[rejected] != 0).all()  # so the zeros below are the mask's doing
    assert torch.equal(masked[rejected], torch.zeros(int(rejected.sum())))
    # exact: the kept tokens go through the same operations with the same denominators (the global batch's
    # counts, rejected tokens included); dividing by fewer tokens would scale these gradients up
    kept = mask.bool() & ~rejected
    assert torch.equal(masked[kept], plain[kept])
    # 7 of the 11 response tokens at token level, sequence 2's 4 of 11 at sequence level
    assert stats["mis_masked_frac"] == pytest.approx(float(rejected.sum()) / 11, abs=1e-7)


def test_mis_off_gives_the_same_loss_bit_for_bit():
    mb = mis_batch()
    mask = mb["response_mask"]
    logprobs = mb["old_logprobs"] + 0.1
    # the surrogate computed directly from the loss function, as the objective did before mis existed
    per_token, _ = ppo_clip_loss(logprobs, mb["old_logprobs"], mb["advantages"], mask, clip_low=0.2, clip_high=0.2)
    direct = aggregate(per_token, mask, mode="token-mean", norm=norm_of(mask))
    loss, stats = policy_objective(AlgoConfig())(logprobs, mb, norm=norm_of(mask))
    assert torch.equal(loss, direct) and "mis_masked_frac" not in stats
    # a band wide enough to reject nothing changes nothing either
    loss, stats = policy_objective(AlgoConfig(mis_low=1e-3, mis_high=1e3))(logprobs, mb, norm=norm_of(mask))
    assert torch.equal(loss, direct) and stats["mis_masked_frac"] == 0.0


def test_mis_composes_with_tis_and_keeps_its_denominator():
    # one sequence, on-policy (ratio 1, loss -A * TIS weight per token), A = 1 everywhere; rollout ratios
    # [0.25, 1.5, 1.0]: band [0.5, 2] rejects the first, tis_cap 1.2 caps the second
    mask = torch.ones(1, 3)
    old = torch.zeros(1, 3)
    mb = {"response_mask": mask, "old_logprobs": old, "advantages": torch.ones(1, 3),
          "rollout_logprobs": old - torch.tensor([[LN(0.25), LN(1.5), 0.0]])}
    algo = AlgoConfig(tis_cap=1.2, mis_low=0.5, mis_high=2.0)
    loss, stats = policy_objective(algo)(old.clone().requires_grad_(True), mb, norm=norm_of(mask))
    # token mean over all 3 tokens: (0 + -1.2 + -1.0) / 3
    assert float(loss.detach()) == pytest.approx(-2.2 / 3, abs=1e-6)
    assert stats["mis_masked_frac"] == pytest.approx(1 / 3, abs=1e-7)
    # the TIS statistic still reports every response token's weight, rejected or not: (0.25 + 1.2 + 1) / 3
    assert stats["tis_weight_mean"] == pytest.approx(2.45 / 3, abs=1e-6)


def test_mis_on_policy_takes_the_ratio_from_the_training_forward():
    # on-policy, the batch carries no old logprobs: the ratio is detached(logprobs) over the rollout engine's
    mask = torch.ones(1, 2)
    mb = {"response_mask": mask, "advantages": torch.ones(1, 2), "rollout_logprobs": torch.tensor([[-1.0, -1.0]])}
    logprobs = torch.tensor([[-1.0, -1.0 + LN(3.0)]], requires_grad=True)  # ratios 1 and 3
    objective = policy_objective(AlgoConfig(mis_low=0.5, mis_high=2.0), on_policy=True)
    assert objective.fields == ("response_mask", "advantages", "rollout_logprobs")
    loss, stats = objective(logprobs, mb, norm=norm_of(mask))
    loss.backward()
    assert stats["mis_masked_frac"] == pytest.approx(0.5)
    # token mean: d(-A * ratio)/d logp = -A at ratio 1, over 2 tokens; the rejected token gets nothing
    assert logprobs.grad.tolist() == [[-0.5, 0.0]]


def test_mis_at_sequence_level_rejects_whole_gspo_sequences():
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    zeros = torch.zeros(2, 2)
    # sequence 0's rollout ratios 4 and 4 (geometric mean 4, rejected), sequence 1's 1 and 1
    mb = {"response_mask": mask, "old_logprobs": zeros, "advantages": torch.ones(2, 2),
          "rollout_logprobs": torch.tensor([[-LN(4.0), -LN(4.0)], [0.0, 0.0]])}
    algo = AlgoConfig(name="gspo", loss_agg="seq-mean-token-mean", mis_low=0.5, mis_high=2.0, mis_level="sequence")
    logprobs = zeros.clone().requires_grad_(True)
    loss, stats = policy_objective(algo)(logprobs, mb, norm=norm_of(mask))
    loss.backward()
    # sequence 1's loss -A * s = -1, divided by both sequences
    assert float(loss.detach()) == pytest.approx(-0.5)
    assert stats["mis_masked_frac"] == pytest.approx(0.5)
    assert logprobs.grad.tolist() == [[0.0, 0.0], [-0.25, -0.25]]


@pytest.mark.parametrize("mis_level, loss, grad", [
    ("token", -0.5, [[0.0, -0.5]]),     # token 0 rejected (its ratio is NaN); token 1: -A, over both tokens
    ("sequence", 0.0, [[0.0, 0.0]]),    # the sequence's mean log-ratio is NaN: rejected whole
    (None, -0.5, [[0.0, -0.5]]),        # TIS alone: a non-finite log-ratio gets weight 0, as if rejected
])
def test_a_nan_rollout_logprob_reaches_neither_the_loss_nor_the_gradient(mis_level, loss, grad):
    mask = torch.ones(1, 2)
    old = torch.tensor([[-1.0, -1.0]])
    mb = {"response_mask": mask, "old_logprobs": old, "advantages": torch.ones(1, 2),
          "rollout_logprobs": torch.tensor([[math.nan, -1.0]])}
    mis = {} if mis_level is None else {"mis_low": 0.5, "mis_high": 2.0, "mis_level": mis_level}
    logprobs = old.clone().requires_grad_(True)
    value, stats = policy_objective(AlgoConfig(tis_cap=2.0, **mis))(logprobs, mb, norm=norm_of(mask))
    value.backward()
    assert float(value.detach()) == loss
    assert logprobs.grad.tolist() == grad
    assert stats["tis_weight_mean"] == 0.5  # weights [0, 1], token mean


# (token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm) of tokens with loss -1 each:
# `kept` of them, in sequences of `n` tokens, in a batch of `seqs` sequences and `tokens` tokens (T = n)
def kept_loss(mode: str, *, kept: int, n: int, seqs: int, tokens: int) -> float:
    return {"token-mean": -kept / tokens, "seq-mean-token-sum": -kept / seqs,
            "seq-mean-token-mean": -kept / n / seqs, "seq-mean-token-sum-norm": -kept / (seqs * n)}[mode]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_a_rejected_token_adds_exactly_zero_loss_and_gradient_whatever_its_ratios(level, loss_agg):
    # two sequences of two tokens; token (0, 0) is rejected (with sequence 0 at sequence level) for any rollout
    # logprob that leaves the band or is not a number, whatever the trainer's ratio there, the advantage's sign
    # and TIS. Every other token is on-policy with A = 1: loss -1 each, and gradient -1 over the denominators.
    mask = torch.ones(2, 2)
    old = torch.full((2, 2), -1.0)
    kept = 3 if level == "token" else 2
    expected = kept_loss(loss_agg, kept=kept, n=2, seqs=2, tokens=4)
    rejected = torch.tensor([[True, level == "sequence"], [False, False]])
    for rollout in (math.nan, math.inf, -math.inf, -100.0, 100.0):
        for log_ratio in (0.0, 25.0, -25.0, 1000.0):
            for advantage in (1.0, -1.0):
                for tis_cap in (None, 2.0):
                    mb = {"response_mask": mask, "old_logprobs": old,
                          "advantages": torch.tensor([[advantage, 1.0], [1.0, 1.0]]),
                          "rollout_logprobs": torch.tensor([[rollout, -1.0], [-1.0, -1.0]])}
                    logprobs = (old + torch.tensor([[log_ratio, 0.0], [0.0, 0.0]])).requires_grad_(True)
                    algo = AlgoConfig(loss_agg=loss_agg, tis_cap=tis_cap, mis_low=0.5, mis_high=2.0, mis_level=level)
                    loss, _ = policy_objective(algo)(logprobs, mb, norm=norm_of(mask))
                    loss.backward()
                    case = (rollout, log_ratio, advantage, tis_cap)
                    assert float(loss.detach()) == pytest.approx(expected, abs=1e-7), case
                    assert (logprobs.grad[rejected] == 0).all(), (case, logprobs.grad)
                    assert (logprobs.grad[~rejected] == expected / kept).all(), (case, logprobs.grad)


GARBAGE = torch.tensor([[math.nan, math.inf], [-math.inf, 1e30]])  # what padding may hold


@pytest.mark.parametrize("algo", [
    AlgoConfig(tis_cap=2.0, kl_coef=0.1), AlgoConfig(dual_clip=3.0, entropy_coef=0.01),
    AlgoConfig(name="gspo", mis_low=0.5, mis_high=2.0, mis_level="sequence", kl_coef=0.1),
], ids=["ppo_tis_kl", "ppo_dual_clip_entropy", "gspo"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_an_all_masked_batch_gives_zero_loss_and_zero_gradient(algo, loss_agg):
    mask = torch.zeros(2, 2)
    mb = {"response_mask": mask, "old_logprobs": GARBAGE, "advantages": GARBAGE, "ref_logprobs": GARBAGE.flip(1),
          "rollout_logprobs": GARBAGE.flip(0)}
    logprobs = GARBAGE.flip(0, 1).clone().requires_grad_(True)
    objective = policy_objective(dataclasses.replace(algo, loss_agg=loss_agg))
    loss, stats = objective(logprobs, mb, norm=norm_of(mask), entropy=GARBAGE.clone())
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 2)), logprobs.grad
    assert all(float(v) == 0.0 for v in stats.values()), stats


@pytest.mark.parametrize("algo", [
    AlgoConfig(mis_low=0.5, mis_high=2.0), AlgoConfig(tis_cap=2.0, mis_low=0.5, mis_high=2.0, mis_level="sequence"),
    AlgoConfig(name="gspo", mis_low=0.5, mis_high=2.0, mis_level="sequence"),
], ids=["ppo_token", "ppo_tis_sequence", "gspo"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_a_batch_with_every_token_rejected_gives_zero_loss_and_zero_gradient(algo, loss_agg):
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old = torch.full((2, 2), -1.0)
    mb = {"response_mask": mask, "old_logprobs": old, "advantages": torch.tensor([[1.0, -1.0], [1.0, 0.0]]),
          "rollout_logprobs": torch.tensor([[math.nan, -10.0], [-math.inf, 0.0]])}
    logprobs = (old + torch.tensor([[0.1, 30.0], [-0.1, 0.0]])).requires_grad_(True)
    loss, stats = policy_objective(dataclasses.replace(algo, loss_agg=loss_agg))(logprobs, mb, norm=norm_of(mask))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 2)), logprobs.grad
    assert stats["mis_masked_frac"] == 1.0


def test_entropy_bonus_lowers_the_loss_by_its_weight():
    mask = torch.tensor([[1.0, 1.0]])
    mb = {"response_mask": mask, "old_logprobs": torch.zeros(1, 2), "advantages": torch.zeros(1, 2)}
    entropy = torch.tensor([[2.0, 4.0]])
    loss, stats = policy_objective(AlgoConfig(entropy_coef=0.1))(torch.zeros(1, 2), mb, norm=norm_of(mask),
                                                                 entropy=entropy)
    assert stats["entropy"] == pytest.approx(3.0)
    assert float(loss) == pytest.approx(-0.3)


def test_the_objective_reads_only_the_fields_it_declares():
    batch = make_batch(rewards=[1.0, 0.0], mask=[[0, 1, 1], [0, 1, 0]], ref=[[0.0, -1.0, -1.0], [0.0, -2.0, 0.0]])
    batch = batch.replace(advantages=torch.ones(2, 3))
    cases = {AlgoConfig(): ("response_mask", "old_logprobs", "advantages"),
             AlgoConfig(kl_coef=0.1): ("response_mask", "old_logprobs", "advantages", "ref_logprobs"),
             AlgoConfig(name="ppo", kl_coef=0.1, kl_in_reward=True): ("response_mask", "old_logprobs", "advantages"),
             AlgoConfig(tis_cap=2.0): ("response_mask", "old_logprobs", "advantages", "rollout_logprobs"),
             AlgoConfig(mis_low=0.5, mis_high=2.0): ("response_mask", "old_logprobs", "advantages", "rollout_logprobs")}
    for algo, fields in cases.items():
        objective = policy_objective(algo)
        assert objective.fields == fields, algo
        inputs = objective.inputs(batch)
        assert set(inputs) == set(fields)
        loss, stats = objective(torch.zeros(2, 3, requires_grad=True), inputs, norm=norm_of(batch.response_mask))
        assert torch.isfinite(loss)
        assert ("kl" in stats) == ("ref_logprobs" in fields)


def test_kl_loss_has_no_nan_gradient_from_masked_positions():
    # The prompt column holds a logprob far below anything a response token has: with k3, exp(ref - logprob)
    # overflows there. Masked positions must not reach the loss or its gradient at all.
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    mb = {"response_mask": mask, "old_logprobs": torch.tensor([[0.0, -1.0, -1.0]]), "advantages": torch.zeros(1, 3),
          "ref_logprobs": torch.tensor([[0.0, -1.2, -0.9]])}
    logprobs = torch.tensor([[-100.0, -1.0, -1.0]], requires_grad=True)
    loss, stats = policy_objective(AlgoConfig(kl_coef=0.5, kl_estimator="k3"))(logprobs, mb, norm=norm_of(mask))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all(), logprobs.grad
    assert logprobs.grad[0, 0] == 0.0
    # k3 with d = ref - logprob: e^-0.2 + 0.2 - 1 and e^0.1 - 0.1 - 1, token mean
    expected = ((math.exp(-0.2) + 0.2 - 1) + (math.exp(0.1) - 0.1 - 1)) / 2
    assert stats["kl"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("loss_agg, kl_loss_agg, expected_kl_term", [
    # sequence 0: one token with k1 KL 1.0; sequence 1: three tokens with KL 0
    ("seq-mean-token-mean", None, (1.0 + 0.0) / 2),   # GRPO's aggregation, for the KL term too
    ("token-mean", None, 1.0 / 4),
    ("seq-mean-token-mean", "token-mean", 1.0 / 4),   # algo.kl_loss_agg overrides it
])
def test_kl_loss_term_is_aggregated_like_the_recipe_says(loss_agg, kl_loss_agg, expected_kl_term):
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    zeros = torch.zeros(2, 3)
    mb = {"response_mask": mask, "old_logprobs": zeros, "advantages": zeros,  # no policy-gradient term
          "ref_logprobs": torch.tensor([[-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])}
    algo = AlgoConfig(kl_coef=0.2, kl_estimator="k1", loss_agg=loss_agg, kl_loss_agg=kl_loss_agg)
    loss, stats = policy_objective(algo)(zeros.clone().requires_grad_(), mb, norm=norm_of(mask))
    assert float(loss) == pytest.approx(0.2 * expected_kl_term)
    assert stats["kl"] == pytest.approx(1.0 / 4)  # the logged KL is a token mean whatever the aggregation


@pytest.mark.parametrize("algo", [
    AlgoConfig(), AlgoConfig(dual_clip=3.0), AlgoConfig(tis_cap=2.0), AlgoConfig(kl_coef=0.1),
    AlgoConfig(name="gspo", loss_agg="seq-mean-token-mean"), AlgoConfig(tis_cap=2.0, mis_low=0.5, mis_high=2.0),
    AlgoConfig(name="gspo", loss_agg="seq-mean-token-mean", mis_low=0.5, mis_high=2.0, mis_level="sequence"),
], ids=["ppo", "dual_clip", "tis", "kl", "gspo", "tis_mis", "gspo_mis"])
def test_extreme_ratios_give_finite_loss_and_gradients(algo):
    # log-ratios of +-1000 nats (one token of each sign, with either sign of advantage)
    mask = torch.ones(2, 2)
    old = torch.tensor([[-1000.0, 0.0], [0.0, -1000.0]])
    mb = {"response_mask": mask, "old_logprobs": old, "advantages": torch.tensor([[1.0, 1.0], [-1.0, -1.0]]),
          "ref_logprobs": torch.zeros(2, 2), "rollout_logprobs": torch.full((2, 2), -500.0)}
    logprobs = torch.tensor([[0.0, -1000.0], [-1000.0, 0.0]], requires_grad=True)
    loss, stats = policy_objective(algo)(logprobs, mb, norm=norm_of(mask))
    loss.backward()
    assert torch.isfinite(loss), float(loss)
    assert torch.isfinite(logprobs.grad).all(), logprobs.grad
    assert all(math.isfinite(float(v)) for v in stats.values()), stats


@pytest.mark.parametrize("advantage", [-1.0, 1.0])
@pytest.mark.parametrize("algo, bound", [
    (AlgoConfig(), 20.0),                                           # PPO: each token's log-ratio
    (AlgoConfig(name="gspo", loss_agg="seq-mean-token-mean"), 10.0),  # GSPO: the sequence's mean log-ratio
], ids=["ppo", "gspo"])
def test_a_ratio_past_its_bound_gives_a_finite_loss_and_no_gradient(algo, bound, advantage):
    # one sequence of two tokens, both log-ratios 1 past the bound (e^11 for GSPO, e^21 for PPO): the loss is
    # that of the bounded ratio e^bound, and no gradient passes, for either sign of the advantage. Just
    # inside the bound the gradient is the formula's.
    mask = torch.ones(1, 2)
    old = torch.full((1, 2), -30.0)
    mb = {"response_mask": mask, "old_logprobs": old, "advantages": torch.full((1, 2), advantage)}
    for past, grad in ((1.0, 0.0), (-0.5, None)):
        logprobs = (old + bound + past).requires_grad_(True)
        loss, _ = policy_objective(algo)(logprobs, mb, norm=norm_of(mask))
        loss.backward()
        ratio = math.exp(min(bound + past, bound))
        clipped = max(min(ratio, 1 + algo.clip_high), 1 - algo.clip_low)
        assert float(loss.detach()) == pytest.approx(max(-advantage * ratio, -advantage * clipped), rel=1e-6)
        if grad is not None:
            assert logprobs.grad.tolist() == [[grad, grad]], logprobs.grad
        elif advantage < 0:  # the unclipped branch: d(-A * r)/d logp_t = -A * r, over the two tokens
            close(logprobs.grad, [[-advantage * ratio / 2] * 2], tol=ratio * 1e-6)
        else:
            assert logprobs.grad.tolist() == [[0.0, 0.0]]  # clipped


# ---- recipe checks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["algo.name=gspo"], "loss_agg must be seq-mean-token-mean"),
    (["algo.name=grpo", "algo.kl_in_reward=true"], "kl_in_reward needs per-token advantages"),
    (["algo.name=ppo", "algo.kl_target=0.1"], "kl_target adapts"),
    (["algo.dual_clip=1.0"], "algo.dual_clip: must be > 1"),
    (["algo.lam=1.5"], "algo.lam: must be in"),
    (["algo.name=dapo", "rollout.n_samples=1", "train.micro_batch_size=1"], "needs rollout.n_samples >= 2"),
])
def test_inconsistent_algorithm_settings_name_the_keys(tmp_path, overrides, message):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {tmp_path}}}\ndata: {{train_path: {data}}}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(recipe, overrides)


# ---- the batch under dynamic sampling ----------------------------------------------------------------------
def test_select_and_concat_keep_every_field_aligned():
    a = make_batch(rewards=[1.0, 0.0], mask=[[0, 1], [0, 1]], group_ids=[0, 0])
    b = make_batch(rewards=[0.5, 0.5, 0.0], mask=[[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]], group_ids=[1, 1, 2])
    joined = RolloutBatch.concat([a, b.select(torch.tensor([2, 0]))], pad_id=-1)
    assert len(joined) == 4 and joined.tokens.shape == (4, 4)
    assert joined.tokens[:2, 2:].eq(-1).all() and joined.response_mask[:2, 2:].eq(0).all()
    assert joined.rewards.tolist() == [1.0, 0.0, 0.0, 0.5]
    assert joined.group_ids.tolist() == [0, 0, 2, 1]
    assert joined.responses == ["r0", "r1", "r2", "r0"]
    assert torch.equal(joined.tokens[2], b.tokens[2]) and torch.equal(joined.response_mask[3], b.response_mask[0])
    assert joined.ref_logprobs is None
    with pytest.raises(ValueError, match="set in some batches only"):
        RolloutBatch.concat([a, b.replace(advantages=torch.zeros(3, 4))], pad_id=0)


def test_the_update_is_on_policy_only_with_one_step_per_batch_and_nothing_reading_old_logprobs_before_it():
    assert AlgoConfig().on_policy
    assert AlgoConfig(kl_coef=0.1).on_policy  # a KL loss term reads the training forward's own logprobs
    assert not AlgoConfig(epochs=2).on_policy  # the second epoch's model is not the one that sampled
    # a KL in the reward is computed from the old logprobs before the update, for the advantages
    assert not AlgoConfig(name="ppo", kl_coef=0.1, kl_in_reward=True).on_policy
    assert AlgoConfig(name="ppo", kl_coef=0.0, kl_in_reward=True).on_policy  # no reference, no KL
    assert not AlgoConfig(recompute_old_logprobs=True).on_policy


def test_an_on_policy_loss_neither_reads_nor_needs_old_logprobs_in_the_batch():
    # one token, advantage 1, logprob -1: with the old logprob taken from the forward the ratio is 1
    objective = policy_objective(AlgoConfig(), on_policy=True)
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    mb = {"response_mask": torch.tensor([[0.0, 1.0]]), "advantages": torch.tensor([[0.0, 1.0]])}
    loss, stats = objective(logprobs, mb, norm=LossNorm(tokens=1.0, seqs=1.0, max_len=2))
    loss.backward()
    close(loss.detach(), -1.0)  # -ratio * A
    close(logprobs.grad, [[0.0, -1.0]])  # d(-exp(lp - sg(lp)) * A) / d lp = -A
    assert float(stats["clipfrac"]) == 0.0 and float(stats["ppo_kl"]) == 0.0
