"""The exact-answer reward on hand-written responses, and what `reward.unfinished` does to a batch's rewards."""

from __future__ import annotations

import pytest
import torch

from megarl.rewards.exact import exact_answer_reward, response_answer


@pytest.mark.parametrize("response, answer, reward", [
    ("9130", "9130", 1.0),
    ("  9130 ", "9130", 1.0),  # surrounding whitespace is ignored
    ("9130\n2+2=4", "9130", 1.0),  # the answer ends at the first newline
    ("9130<|endoftext|>junk", "9130", 1.0),  # ...or at an end-of-text marker left in the text
    ("9130<|im_end|>", "9130", 1.0),
    ("9131", "9130", 0.0),
    ("91300", "9130", 0.0),  # a longer answer is a different answer
    ("913", "9130", 0.0),
    ("9130.", "9130", 0.0),
    ("\n9130", "9130", 0.0),  # an empty first line is an empty answer
    ("", "9130", 0.0),
    ("", "", 1.0),
    ("82", " 82\n", 1.0),  # the reference is stripped too
])
def test_exact_answer_reward(response, answer, reward):
    assert exact_answer_reward(response, answer) == reward


def test_response_answer_is_the_first_line_stripped():
    assert response_answer(" 12 + 3 \nmore") == "12 + 3"
    assert response_answer("<|endoftext|>12") == ""


def test_unfinished_reward_replaces_the_whole_sum_of_every_sample_a_limit_cut_off():
    """Samples ended by a limit (length, max_turns, max_tokens, tool_time) get `reward.unfinished` in place of
    their terms', reward models' and environment's sum; one the model ended, or one whose environment failed,
    keeps its sum; unset, every sample keeps it."""
    from megarl.batch import RolloutBatch
    from megarl.loops.samples import with_rewards

    reasons = ["stop", "length", "max_turns", "max_tokens", "tool_time", "env_error"]
    n = len(reasons)
    batch = RolloutBatch(tokens=torch.ones(n, 4, dtype=torch.long), response_mask=torch.ones(n, 4),
                         prompt_lens=torch.ones(n, dtype=torch.long), group_ids=torch.arange(n),
                         rollout_logprobs=torch.zeros(n, 4), responses=[""] * n, answers=[""] * n,
                         finish_reasons=reasons, prompt_texts=[""] * n, metadata=[{}] * n,
                         env_rewards=torch.full((n,), 0.5))
    terms = torch.arange(n, dtype=torch.float32)
    kept = with_rewards(batch, terms, reward_models=[], micro_batch_size=n, pad_id=0)
    assert kept.rewards.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    cut = with_rewards(batch, terms, reward_models=[], micro_batch_size=n, pad_id=0, unfinished=-10.0)
    assert cut.rewards.tolist() == [0.5, -10.0, -10.0, -10.0, -10.0, 5.5]
    assert cut.rewards.dtype == torch.float32
