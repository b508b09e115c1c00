"""Preference pairs from the built-in tiny task, for training a reward model (recipes/rm.py).

For each problem of a split, the chosen response is the correct demonstration (``"12 + 7 = 19\\n#### 19"``)
and the rejected one a wrong response of one of three kinds, drawn deterministically from a seed: half the
right working with a wrong result (off by 1 to 3, the slips the tiny task's noisy demonstrations make),
a quarter the right working with another final answer, a quarter a misread problem (an operand off by 1
to 3, worked out consistently). The last two keep a policy that learns from the model's score from
finding wrong responses it has never seen ranked (a first version with only the first kind was exploited
by GRPO within 10 steps: docs/rewards.md). Train pairs come from the train split, held-out pairs
from the test split, so held-out pairwise accuracy measures problems the reward model never saw. The
ground truth, not a train row's (possibly wrong) demonstration, decides which answer is chosen.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from spmdrl.data.tiny_task import TinyTaskConfig, demonstration, generate

# A demonstration's working: "<a> <op> <b> = ..." (spmdrl.data.tiny_task.demonstration).
_WORKING = re.compile(r"^(\d+) ([+-]) (\d+) = ")


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: the prompt's chat messages and two responses, the first preferred."""

    messages: list[dict[str, str]]
    chosen: str
    rejected: str


def wrong_answer(true: int, rng: random.Random) -> int:
    """Off by 1 to 3 in either direction; never negative (the task has no negative answers)."""
    delta = rng.choice((-3, -2, -1, 1, 2, 3))
    return true + delta if true + delta >= 0 else true - delta


def pairs_from_rows(rows: list[dict], seed: int, split: str) -> list[PreferencePair]:
    """A pair per tiny-task row, its wrong answer drawn from a stream of its own (seed, split)."""
    rng = random.Random(f"tiny_pairs/{seed}/{split}")
    pairs = []
    for row in rows:
        m = _WORKING.match(row["response"])
        if m is None:
            raise ValueError(f"a tiny-task response without its working: {row['response']!r}")
        combo = (m.group(2), int(m.group(1)), int(m.group(3)))
        true = int(row["reward_model"]["ground_truth"])
        pairs.append(
            PreferencePair(
                messages=list(row["prompt"]),
                chosen=demonstration(combo, true),
                rejected=rejected_response(combo, true, rng),
            )
        )
    return pairs


def rejected_response(combo: tuple[str, int, int], true: int, rng: random.Random) -> str:
    """A wrong response to ``combo`` (whose answer is ``true``): see the module docstring for the kinds."""
    op, a, b = combo
    kind = rng.random()
    if kind < 0.5:  # a slip in the result
        return demonstration(combo, wrong_answer(true, rng))
    if kind < 0.75:  # the right working, another final answer
        return f"{a} {op} {b} = {true}\n#### {wrong_answer(true, rng)}"
    # A misread operand, worked out consistently (never the true answer, never negative).
    for _ in range(20):
        a2 = wrong_answer(a, rng) if rng.random() < 0.5 else a
        b2 = b if a2 != a else wrong_answer(b, rng)
        answer = a2 + b2 if op == "+" else a2 - b2
        if answer >= 0 and answer != true:
            return demonstration((op, a2, b2), answer)
    return demonstration(combo, wrong_answer(true, rng))


def tiny_pairs(cfg: TinyTaskConfig, seed: int) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs of the tiny task ``cfg`` (tiny_task.*), deterministic from ``seed``."""
    train, test = generate(cfg)
    return pairs_from_rows(train, seed, "train"), pairs_from_rows(test, seed, "test")
