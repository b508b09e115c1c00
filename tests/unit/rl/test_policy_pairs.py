"""spmdrl/rl/policy_pairs.py: pairs from a policy's samples, labelled by the tiny task's rule."""

from __future__ import annotations

import random

from spmdrl.data.tiny_pairs import PreferencePair
from spmdrl.rewards.tiny import compute_score
from spmdrl.rl.policy_pairs import balance_directions, pairs_from_samples

MESSAGES = [{"role": "user", "content": "Tom has 2 apples and gets 3 more. How many apples does Tom have?"}]


def test_right_chosen_wrong_rejected_distinct_and_capped() -> None:
    responses = ["2 + 3 = 5\n#### 5"] * 3 + [
        "2 + 3 = 6\n#### 6",
        "2 + 3 = 4\n#### 4",
        "#### 6",
        "2 + 3 = 6\n#### 6",
    ]
    pairs = pairs_from_samples(MESSAGES, responses, "5", max_pairs=2, rng=random.Random(0))
    assert len(pairs) == 2
    for p in pairs:
        assert p.messages == MESSAGES
        assert compute_score(p.chosen, "5") == 1.0 and compute_score(p.rejected, "5") == 0.0
    assert len({p.rejected for p in pairs}) == 2, "distinct wrong samples before any repeats"
    # Fewer distinct samples than the cap: one pair per distinct sample of the larger side.
    assert len(pairs_from_samples(MESSAGES, responses, "5", max_pairs=10, rng=random.Random(0))) == 3


def test_no_pair_where_the_samples_agree() -> None:
    assert pairs_from_samples(MESSAGES, ["#### 5"] * 4, "5", 2, random.Random(0)) == []
    assert pairs_from_samples(MESSAGES, ["#### 6", "#### 4"], "5", 2, random.Random(0)) == []
    assert pairs_from_samples(MESSAGES, [], "5", 2, random.Random(0)) == []


def test_balance_directions_keeps_as_many_wrong_answers_above_as_below() -> None:
    def pair(chosen: int, rejected: str) -> PreferencePair:
        return PreferencePair(MESSAGES, f"#### {chosen}", rejected)

    pairs = [pair(5, "#### 6")] * 5 + [pair(5, "#### 4")] * 2 + [pair(5, "no answer")]
    kept = balance_directions(pairs, seed=0)
    assert sorted(p.rejected for p in kept) == ["#### 4", "#### 4", "#### 6", "#### 6", "no answer"]
    assert balance_directions(pairs, seed=0) == kept
