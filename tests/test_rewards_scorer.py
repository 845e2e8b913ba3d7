"""The scorer: weighted terms from the recipe, the failure policy (raise, NaN, timeout -> 0, counted, one
log line), custom functions by import path, and the Ray pool (same rewards, survives a dying worker)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest

from megarl.config import RecipeError, RewardConfig, RewardTermConfig
from megarl.rewards.scorer import Scorer
from megarl.rewards.terms import Sample, SampleTimeout, build_terms, score_sample, time_limit

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
    assert "reward.terms[1] (reward_fns:fails_on_bad): RuntimeError: cannot score this one" in record.message


def test_score_sample_names_each_kind_of_failure():
    terms = build_terms(RewardConfig(terms=[term("custom", function="reward_fns:fails_on_bad")], timeout_s=0.3))
    reasons = [score_sample(terms, Sample("", r, ""), timeout_s=0.3)[1] for r in ("bad", "nan", "slow")]
    name = "reward.terms[0] (reward_fns:fails_on_bad)"
    assert reasons == [f"{name}: RuntimeError: cannot score this one", f"{name}: returned nan, not a finite number",
                       f"{name}: scoring took longer than 0.3 s"]
    assert math.isnan(score_sample(terms, Sample("", "bad", ""), timeout_s=1)[0])  # settle() makes it 0


@pytest.mark.parametrize("returned, shown", [("1.0", "'1.0' (str)"), (None, "None (NoneType)"),
                                              ([1.0], "[1.0] (list)")])
def test_a_reward_that_is_not_a_number_fails_its_sample(returned, shown):
    terms = [(1.0, lambda s: 0.5, "reward.terms[0] (format)"), (1.0, lambda s: returned, "reward.terms[1] (f:g)")]
    value, why = score_sample(terms, Sample("", "x", ""), timeout_s=1)
    assert math.isnan(value) and why == f"reward.terms[1] (f:g): returned {shown}, not a number"


def test_a_reward_beyond_float32_fails_its_sample_and_float32_max_does_not():
    """The batch holds rewards in float32: a sum above its largest value would train as inf."""
    import torch

    big = float(torch.finfo(torch.float32).max)
    for weights, ok in (((1.0, 0.0), True), ((1.0, 1.0), False), ((-1.0, -1.0), False)):
        terms = [(weights[0], lambda s: big, "a"), (weights[1], lambda s: big, "b")]
        value, why = score_sample(terms, Sample("", "x", ""), timeout_s=1)
        assert (value, why) == (weights[0] * big, None) if ok else (math.isnan(value) and "beyond float32" in why)
    value, why = score_sample([(1.0, lambda s: -math.inf, "a")], Sample("", "x", ""), timeout_s=1)
    assert math.isnan(value) and why == "a: returned -inf, not a finite number"


def test_bools_and_numpy_numbers_are_numbers():
    import numpy as np

    terms = [(1.0, lambda s: True, "a"), (2.0, lambda s: np.float32(0.25), "b"), (1.0, lambda s: 3, "c")]
    assert score_sample(terms, Sample("", "x", ""), timeout_s=1) == (4.5, None)


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


def test_a_code_term_scores_the_response_against_the_answer_tests(isolated):
    cfg = RewardConfig(terms=[term("code")])
    tests = '{"calls": [{"call": "square(3)", "expected": "9"}]}'
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


# ---- scoring while generating ----------------------------------------------------------------------------
def test_a_batch_must_get_each_sample_exactly_once():
    scoring = Scorer(RewardConfig()).batch(3)
    scoring.submit(2, Sample("", "1", "1"))
    with pytest.raises(ValueError, match="sample 2 of the batch was handed in twice"):
        scoring.submit(2, Sample("", "1", "1"))
    with pytest.raises(ValueError, match="2 of 3 samples were never handed in, the first is 0"):
        scoring.result()


def test_a_reward_failed_outside_the_terms_scores_zero_and_counts_once(caplog):
    # what an environment's failed step reward does (megarl.loops.samples.generate_part): sample 0 fails
    # there alone, sample 1 there and in its term (one failure, the term's reason first), sample 2 is scored
    scoring = Scorer(RewardConfig(terms=[term("custom", function="reward_fns:fails_on_bad")])).batch(3)
    for i, response in enumerate(("ok", "bad", "ok")):
        scoring.submit(i, Sample("", response, ""))
    scoring.fail(0, "env.name (m:Env): a step returned reward nan (float), not a finite number")
    scoring.fail(1, "env.name (m:Env): a step returned reward inf (float), not a finite number")
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
        rewards, failures, _ = scoring.result()
    assert rewards == [0.0, 0.0, 1.0] and failures == 2
    [record] = caplog.records
    assert "2 of 3 rewards failed" in record.message
    assert scoring.scorer.first_failure.startswith("env.name (m:Env): a step returned reward nan (float)")


@pytest.mark.timeout(120)
def test_samples_handed_to_the_pool_out_of_order_keep_the_failure_policy(ray_local, caplog):
    cfg = RewardConfig(terms=[term("format", weight=0.5, pattern="ok"),
                              term("custom", function="reward_fns:fails_on_bad")], timeout_s=0.5, workers=2)
    responses = ("ok", "bad", "nan", "slow", "swallowing", "ok too")
    scorer = Scorer(cfg)
    try:
        scoring = scorer.batch(len(responses))
        for i in reversed(range(len(responses))):
            scoring.submit(i, Sample("", responses[i], ""))
        # every sample left for the workers as it came (chunks of one: 6 samples, 2 workers); once all are
        # back, every sample counts as scored before the result was asked for
        tasks = [ref for _, ref in scoring.sent]
        assert len(tasks) == 6 and len(ray_local.wait(tasks, num_returns=6, timeout=60)[0]) == 6
        with caplog.at_level(logging.WARNING, logger="megarl.rewards.scorer"):
            rewards, failures, scored_before = scoring.result()
    finally:
        scorer.close()
    # what in-process scoring of the same samples gives (test_failures_score_zero_are_counted_and_logged_once)
    assert rewards == [1.5, 0.0, 0.0, 0.0, 0.0, 1.5] and failures == 4 and scored_before == 6
    [record] = caplog.records
    assert "4 of 6 rewards failed" in record.message and "'bad'" in record.message


@pytest.mark.timeout(180)
def test_the_pool_survives_dying_workers_while_samples_stream_in(ray_local, tmp_path):
    scorer = Scorer(RewardConfig(terms=[term("custom", function="reward_fns:dies_once_per_marker")], workers=2))
    try:
        scoring = scorer.batch(4)  # chunks of one sample: each task's first worker dies, its retry scores
        for i in (2, 0, 3, 1):
            scoring.submit(i, Sample("", "r", "", {"marker": str(tmp_path / f"marker{i}")}))
        rewards, failures, _ = scoring.result()
    finally:
        scorer.close()
    assert (rewards, failures) == ([1.0] * 4, 0)
    assert all((tmp_path / f"marker{i}").exists() for i in range(4))


# A reward that changes with every field of a sample, plus one on its length in tokens.
DIGEST = RewardConfig(terms=[term("custom", function="reward_fns:digest"),
                             term("length_penalty", weight=0.5, max_tokens=12, cache_tokens=4)])


def generate_scored(model_dir, groups, scorer: Scorer, *, seed: int):
    """The loop's generate() of 6 prompts x 2 samples on a native engine seeded `seed`, every sample handed
    to `scorer` as it ends: the batch, and (rewards, failures, scored before generation ended)."""
    from test_multi_turn import make_run, rows

    from megarl.config import EnvConfig
    from megarl.loops.colocated import generate
    from megarl.rollout.native import NativeEngine

    run = make_run(model_dir, groups, NativeEngine(str(model_dir), seed=seed), env=EnvConfig(),
                   max_new_tokens=12, chat_template=False)
    run.scorer = scorer
    generated = generate(run, run.rollouts, rows(6, bonus="x"), n_samples=2)
    return generated.batch, generated.scoring.result()


@pytest.mark.timeout(300)
def test_rewards_scored_during_generation_equal_the_rewards_of_the_finished_batch(ray_local, qwen2_dir, groups):
    import dataclasses

    import torch

    pooled = Scorer(dataclasses.replace(DIGEST, workers=2))
    try:
        batch, (rewards, failures, _) = generate_scored(qwen2_dir, groups, pooled, seed=7)
    finally:
        pooled.close()
    plain_batch, (plain, plain_failures, scored_before) = generate_scored(qwen2_dir, groups, Scorer(DIGEST), seed=7)
    assert torch.equal(batch.tokens, plain_batch.tokens)  # handing samples out does not change what is sampled
    assert rewards == plain and failures == plain_failures == 0 and scored_before == 0
    # ... and both are the terms on the finished batch's own fields, as scoring after generation sees them
    samples = [Sample(*fields, response_tokens=int(n)) for *fields, n in zip(
        batch.prompt_texts, batch.responses, batch.answers, batch.metadata, batch.response_mask.sum(-1))]
    assert Scorer(DIGEST)(samples) == (rewards, 0)
    assert len(set(rewards)) > 6  # more distinct rewards than prompts: the equalities above compare samples


class GatedEngine:
    """Answers the first prompt at once and holds the others back until some reward has begun scoring (a
    file appears in `started`), failing after `wait_s`: generation can end only if scoring overlaps it."""

    def __init__(self, started: Path, *, wait_s: float):
        self.started, self.wait_s, self.ended = started, wait_s, None

    def generate(self, prompts, *, temperature, top_p, max_new_tokens, eos_id, pad_id, on_response):
        from megarl.rollout.engine import Generation

        response = [30, 31, eos_id]
        on_response(0, response, [-0.5] * 3, "stop")
        deadline = time.monotonic() + self.wait_s
        while not any(self.started.iterdir()):
            if time.monotonic() > deadline:
                raise AssertionError(f"no reward began scoring within {self.wait_s} s of the first response")
            time.sleep(0.02)
        for i in range(1, len(prompts)):
            on_response(i, response, [-0.5] * 3, "stop")
        self.ended = time.time()
        return Generation([response] * len(prompts), [[-0.5] * 3] * len(prompts), ["stop"] * len(prompts))

    def abandon(self) -> None:
        pass

    def rng_state(self) -> None:  # what the run keeps for a restart; this engine has no sampler
        return None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [2, 0])
def test_scoring_on_the_pool_begins_before_generation_ends(ray_local, qwen2_dir, groups, tmp_path, workers):
    from test_multi_turn import make_run, rows

    from megarl.config import EnvConfig
    from megarl.loops.colocated import generate, score
    from megarl.loops.faults import EngineLost

    # In this process nothing is scored before the batch is complete, so there the gate must close (1 s
    # is then plenty); on the pool the first sample's task starts while the engine waits.
    engine = GatedEngine(tmp_path, wait_s=120.0 if workers else 1.0)
    run = make_run(qwen2_dir, groups, engine, env=EnvConfig(), max_new_tokens=4, chat_template=False)
    run.scorer = Scorer(RewardConfig(terms=[term("custom", function="reward_fns:records_start")], workers=workers))
    try:
        # 4 samples on 2 workers: chunks of one, sent as each sample ends
        if not workers:
            # what the engine raised is its failure, and this run has no restart to spend (make_run)
            with pytest.raises(EngineLost, match="no reward began scoring"):
                generate(run, run.rollouts, rows(2, started=str(tmp_path)), n_samples=2)
            return
        generated = generate(run, run.rollouts, rows(2, started=str(tmp_path)), n_samples=2)
        batch, failures, _, engines = score(run, run.rollouts.placement, generated)
    finally:
        run.scorer.close()
    assert batch.rewards.tolist() == [1.0] * 4 and failures == 0 and engines == 1
    starts = sorted(float(f.read_text()) for f in tmp_path.iterdir())
    assert len(starts) == 4 and starts[0] <= engine.ended  # one same-machine clock
