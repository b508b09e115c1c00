"""Reward for the built-in tiny arithmetic task.

A response looks like ``"12 + 7 = 19\\n#### 19"`` and the ground truth is ``"19"``. The answer is
read exactly as GSM8K's strict mode reads it, so a model trained on the tiny task learns the
``#### <answer>`` format that the GSM8K reward expects.
"""

from __future__ import annotations

from spmdrl.rewards import gsm8k

# The ``data_source`` column the tiny task's generated parquet files carry.
DATA_SOURCE = "spmdrl/tiny_arith"
# The built-in visual task's (spmdrl.data.tiny_shapes_task): the same rule, its answer a count.
SHAPES_DATA_SOURCE = "spmdrl/tiny_shapes"


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0) -> float:
    """1.0 if the ``####`` answer equals the ground truth; ``format_score`` if it is there but wrong;
    0.0 if there is none."""
    return gsm8k.compute_score(solution_str, ground_truth, method="strict", format_score=format_score)
