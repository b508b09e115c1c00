"""The GSM8K rule reward (spmdrl/rewards/gsm8k.py): strict and flexible extraction, scores like verl's."""

from __future__ import annotations

import pytest

from spmdrl.rewards import gsm8k

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


# ---------------------------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    "text, expected",
    [
        (GSM8K_SOLUTION, "72"),
        ("so the total is\n#### 1,234", "1234"),
        ("#### -5", "-5"),
        ("#### 3.75", "3.75"),
        ("#### 1 wait, no\n#### 2", "2"),  # the last one counts
        ("The answer is 72", None),  # no ####
        ("####72", None),  # the space is required
        ("#### $18", None),  # as in verl: the number must follow "#### " directly
        ("#### 18.", "18."),  # as in verl: a trailing period stays (and then does not match "18")
    ],
)
def test_gsm8k_strict_extraction(text, expected):
    assert gsm8k.extract_answer(text, "strict") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is $1,234.", "1234"),
        ("She owes -3 dollars, then earns 7.", "7"),
        ("It went from 5 to -12", "-12"),
        ("#### 40\n", "40"),
        ("Nothing numeric here...", None),
    ],
)
def test_gsm8k_flexible_extraction(text, expected):
    assert gsm8k.extract_answer(text, "flexible") == expected


def test_gsm8k_scores_like_verl():
    assert gsm8k.compute_score(GSM8K_SOLUTION, "72") == 1.0
    assert gsm8k.compute_score(GSM8K_SOLUTION, "71") == 0.0  # wrong, default format_score 0.0
    assert gsm8k.compute_score(GSM8K_SOLUTION, "71", format_score=0.1) == 0.1
    assert gsm8k.compute_score("The answer is 72", "72", format_score=0.1) == 0.0  # nothing extracted
    assert gsm8k.compute_score("The answer is 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score(GSM8K_SOLUTION, "72", score=2.0) == 2.0
    assert gsm8k.compute_score("#### 1,000", "1000") == 1.0
    assert gsm8k.compute_score("#### 1000", "1,000") == 1.0  # ground truth normalized the same way
    # Only the last 300 characters are searched: an answer followed by a long tail is not seen.
    assert gsm8k.compute_score("#### 72\n" + "x" * 300, "72") == 0.0
    assert gsm8k.compute_score("x" * 1000 + "\n#### 72", "72") == 1.0
    with pytest.raises(ValueError, match="strict, flexible"):
        gsm8k.extract_answer("#### 1", "loose")
