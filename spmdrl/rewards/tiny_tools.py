"""Reward for the built-in tool task (:mod:`spmdrl.data.tools_task`): multiplying multi-digit numbers.

The response is the whole multi-turn response (every assistant turn and the tool results between
them); the answer is the integer after its last ``####``, and it scores 1.0 if it equals the product.
The calculator's output never contains ``####``, so the model has to write the answer itself.
"""

from __future__ import annotations

import re

# The ``data_source`` column the tool task's generated parquet files carry.
DATA_SOURCE = "tiny_tools"

_ANSWER_RE = re.compile(r"####\s*(-?[0-9][0-9,]*)")


def extract_answer(text: str) -> int | None:
    """The integer after the last ``####`` in ``text`` (commas allowed), or None."""
    matches = _ANSWER_RE.findall(text)
    return int(matches[-1].replace(",", "")) if matches else None


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last ``#### <integer>`` equals the ground truth (an integer), else 0.0."""
    answer = extract_answer(solution_str)
    return float(answer is not None and answer == int(str(ground_truth).strip()))
