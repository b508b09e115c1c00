"""reward.fn=last_number: the last number of the reply, compared numerically with the ground truth."""

from __future__ import annotations

import pytest

from spmdrl.rewards.last_number import compute_score, last_number
from spmdrl.rewards.registry import load_reward_fn


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("The answer is 42.", 42.0),
        ("12 + 7 - 3 = 16", 16.0),  # the last number, not the first
        ("<answer>-5</answer>", -5.0),
        ("about 1,234 apples", 1234.0),
        ("3.5 then .25", 0.25),
        ("no digits here", None),
    ],
)
def test_last_number_reads_the_last_number(text: str, value: float | None) -> None:
    assert last_number(text) == value


def test_score_is_one_only_when_the_last_number_equals_the_ground_truth() -> None:
    assert compute_score("The answer to 6 + 9 - 6 is 9.", "9") == 1.0
    assert compute_score("9 is not it, the sum is 1", "9") == 0.0
    assert compute_score("It is 9.0", "9") == 1.0  # numerically equal
    assert compute_score("I do not know", "9") == 0.0
    assert compute_score("42", "forty-two") == 0.0  # a ground truth with no number scores nothing


def test_registered_as_a_trusted_rule() -> None:
    fn = load_reward_fn("last_number")
    assert fn.trusted
    assert fn("so 7 - 10 = -3", "-3", data_source="reasoning_gym/chain_sum", extra_info={}) == 1.0
