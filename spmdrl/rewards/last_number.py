"""Reward: the last number in the reply equals the ground truth (``reward.fn=last_number``).

For small pretrained chat models that answer in prose ("The sum is 42.") and rarely keep to an answer
format such as ``<answer>...</answer>`` or ``#### 42``: the last number written is taken as the answer,
as reasoning-gym's and lm-eval's lenient ("flexible") extraction do. Commas between digit groups are
dropped (``1,234``); the comparison is numeric, so ``42.0`` matches ``42``. A ground truth that is not a
number scores every reply 0.
"""

from __future__ import annotations

import math
import re

# An optional sign, digits with optional thousands commas, an optional decimal part.
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> float | None:
    """The value of the last number in ``text``, or None where it has none."""
    for match in reversed(_NUMBER.findall(text)):
        try:
            return float(match.replace(",", ""))
        except ValueError:  # "1,,2" and the like: try the number before it
            continue
    return None


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 if the last number in ``response`` equals ``ground_truth`` (numerically), else 0.0."""
    want = last_number(ground_truth.strip())
    got = last_number(response)
    if want is None or got is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=0.0, abs_tol=1e-9) else 0.0
