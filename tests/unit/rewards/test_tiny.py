"""The built-in arithmetic task's reward (spmdrl/rewards/tiny.py)."""

from __future__ import annotations

from spmdrl.rewards import tiny


def test_tiny_reward():
    assert tiny.compute_score("12 + 7 = 19\n#### 19", "19") == 1.0
    assert tiny.compute_score("12 + 7 = 20\n#### 20", "19") == 0.0
    assert tiny.compute_score("12 + 7 = 20\n#### 20", "19", format_score=0.1) == 0.1
    assert tiny.compute_score("12 + 7 = 19", "19", format_score=0.1) == 0.0  # no #### answer
