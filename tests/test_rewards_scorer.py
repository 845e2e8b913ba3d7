"""The scorer: weighted terms from the recipe, the failure policy (raise, NaN, timeout -> 0, counted, one
log line), custom functions by import path, and the Ray pool (same rewards, survives a dying worker)."""

from __future__ import annotations

import logging
import math

import pytest

from megarl.config import RecipeError, RewardConfig, RewardTermConfig
from megarl.rewards.scorer import SampleTimeout, Sample, Scorer, build_terms, score_sample, time_limit

FORMAT = r"\A<think>.*</think>"


def term(kind, **options):
    return RewardTermConfig(kind=kind, **options)


def samples_for_terms() -> list[Sample]:
    return [
        Sample("q1", "<think>2+2</think> #### 4", "#### 4", {"bonus": "think"}, response_tokens=10),
        Sample("q2", "<think>hmm</think> #### 5", "#### 4", {}, response_tokens=90),
        Sample("q3", "#### 4", "#### 4", {}, response_tokens=100),
        Sample("q4", "no idea", "\\frac{1}{2}", {}, response_tokens=200),
        Sample("q5", "$\\boxed{0.5}$", "\\frac{1}{2}", {"bonus": "boxed"}, response_tokens=75),
    ]


MIXED = RewardConfig(terms=[
    term("math", weight=1.0),
    term("format", weight=0.1, pattern=FORMAT),
    term("length_penalty", weight=0.5, max_tokens=100, cache_tokens=50),
    term("custom", weight=2.0, function="reward_fns:answer_in_response"),
])
# By hand: math + 0.1 * format + 0.5 * length penalty (0 up to 50 tokens, -1 at 100) + 2 * custom.
MIXED_EXPECTED = [
    1 + 0.1 + 0 + 2 * 1.0,  # right, formatted, short, answer "#### 4" and "think" both in the response
    0 + 0.1 - 0.5 * 0.8 + 2 * 0.0,  # wrong, formatted, 90 tokens: penalty -(90 - 50) / 50
    1 + 0 - 0.5 * 1.0 + 2 * 0.5,  # right, unformatted, at the limit
    0 + 0 - 0.5 * 1.0 + 2 * 0.0,  # no answer, past the limit
    1 + 0 - 0.5 * 0.5 + 2 * 0.5,  # 0.5 == 1/2; 75 tokens: -0.5; "boxed" hit, answer text not
]


def test_weighted_terms_sum_to_the_hand_computed_rewards():
    rewards, failures = Scorer(MIXED)(samples_for_terms())
    assert failures == 0
    assert rewards == pytest.approx(MIXED_EXPECTED, abs=1e-12)


def test_default_reward_is_exact_answer():
    scorer = Scorer(RewardConfig())
    assert scorer([Sample("", "9130", "9130"), Sample("", "9131", "9130")]) == ([1.0, 0.0], 0)


@pytest.mark.timeout(60)
def test_failures_score_zero_are_counted_and_logged_once(caplog):
    cfg = RewardConfig(terms=[term("format", weight=0.5, pattern="ok"),
                              term("custom", function="reward_fns:fails_on_bad")], timeout_s=0.5)
    samples = [Sample("", r, "") for r in ("ok", "bad", "nan", "slow", "swallowing", "ok too")]
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
        rewards, failures = Scorer(cfg)(samples)
    assert rewards == [1.5, 0.0, 0.0, 0.0, 0.0, 1.5] and failures == 4
    [record] = caplog.records
    assert "4 of 6 rewards failed" in record.message and "'bad'" in record.message
    assert "RuntimeError: cannot score this one" in record.message


def test_score_sample_names_each_kind_of_failure():
    terms = build_terms(RewardConfig(terms=[term("custom", function="reward_fns:fails_on_bad")], timeout_s=0.3))
    reasons = [score_sample(terms, Sample("", r, ""), timeout_s=0.3)[1] for r in ("bad", "nan", "slow")]
    assert reasons == ["RuntimeError: cannot score this one", "reward is nan", "scoring took longer than 0.3 s"]
    assert math.isnan(score_sample(terms, Sample("", "bad", ""), timeout_s=1)[0])  # settle() makes it 0


def test_time_limit_restores_an_outer_timer():
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 5.0)
        with time_limit(1.0):
            pass
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 3.0 < remaining <= 5.0  # re-armed with what was left (slack for a slow machine)
        with pytest.raises(SampleTimeout):
            with time_limit(0.05):
                while True:
                    pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


@pytest.mark.parametrize("spec, what", [
    ("no_such_module_xyz:f", "ModuleNotFoundError"),
    ("reward_fns:missing", "AttributeError"),
    ("reward_fns:NOT_A_FUNCTION", "is a int, not a function"),
])
def test_a_custom_function_that_does_not_import_is_a_recipe_error_naming_the_key(spec, what):
    cfg = RewardConfig(terms=[term("math"), term("custom", function=spec)])
    with pytest.raises(RecipeError) as err:
        Scorer(cfg)
    message = str(err.value)
    assert message.startswith("reward.terms[1].function: ") and repr(spec) in message and what in message


def test_a_code_term_scores_the_response_against_the_answer_tests():
    cfg = RewardConfig(terms=[term("code")])
    tests = "assert square(3) == 9\n"
    samples = [Sample("", "```python\ndef square(x):\n    return x * x\n```", tests),
               Sample("", "```python\ndef square(x):\n    return x + x\n```", tests)]
    assert Scorer(cfg)(samples) == ([1.0, 0.0], 0)


# ---- Ray pool --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance of 2 CPUs, started the way a pool starts it (skipped cleanly without Ray).
    Starting Ray takes seconds, so the pool tests share it; pools that find it running leave it up."""
    ray = pytest.importorskip("ray")
    from megarl.rewards.pool import start_ray

    start_ray(None, workers=2)
    yield ray
    ray.shutdown()


@pytest.mark.timeout(120)
def test_pool_gives_the_in_process_rewards(ray_local):
    samples = samples_for_terms() * 3
    expected = Scorer(MIXED)(samples)
    pooled = Scorer(RewardConfig(terms=MIXED.terms, workers=2))
    assert pooled(samples) == expected
    pooled.close()
    assert ray_local.is_initialized()  # the pool did not start this Ray, so it leaves it running


@pytest.mark.timeout(180)
def test_pool_survives_a_dying_worker_and_fails_only_what_keeps_dying(ray_local, tmp_path):
    samples = [Sample("", "r", "", {"marker": str(tmp_path / f"marker{i // 2}")}) for i in range(4)]
    scorer = Scorer(RewardConfig(terms=[term("custom", function="reward_fns:dies_once_per_marker")], workers=2))
    try:
        # Two chunks of two samples; each chunk's first worker dies on its marker, and the retry scores.
        assert scorer(samples) == ([1.0] * 4, 0)
        assert all((tmp_path / f"marker{i}").exists() for i in range(2))
        doomed = Scorer(RewardConfig(terms=[term("custom", function="reward_fns:always_dies")], workers=2))
        assert doomed([Sample("", "r", "")]) == ([0.0], 1)  # its retry died too: a failure, no crash
        assert scorer(samples) == ([1.0] * 4, 0)  # and the pool still scores afterwards
    finally:
        scorer.close()


def test_rl_reward_terms_see_prompts_metadata_and_response_lengths():
    import torch

    from megarl.batch import RolloutBatch
    from megarl.loops.rl import reward_terms

    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)  # 2 and 3 response tokens
    batch = RolloutBatch(tokens=torch.zeros(2, 4, dtype=torch.long), response_mask=mask,
                         prompt_lens=torch.tensor([1, 1]), group_ids=torch.tensor([0, 0]),
                         rollout_logprobs=torch.zeros(2, 4), responses=["42 bonus", "41"], answers=["42", "42"],
                         finish_reasons=["stop", "length"], prompt_texts=["q", "q"],
                         metadata=[{"bonus": "bonus"}, {"bonus": "bonus"}])
    cfg = RewardConfig(terms=[term("custom", function="reward_fns:answer_in_response"),
                              term("length_penalty", max_tokens=3, cache_tokens=2)])
    rewards, failures = reward_terms(Scorer(cfg), batch)
    # custom: 0.5 (answer) + 0.5 (bonus) and 0; length: 2 tokens -> -0.5, 3 tokens -> -1.
    assert rewards == [0.5, -1.0] and failures == 0
