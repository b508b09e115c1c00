"""A generative reward's text side: an LLM judge reads each (prompt, response) through a prompt template and
answers with a score that a regex reads (reward_model.judge.*; docs/rewards.md#generative-judge). The
engine's side, which serves the judge on the run's own in-process engine, is spmdrl/rl/judge.py.

The judge's prompt is the template rendered with ``{prompt}`` (the sample's last user message),
``{response}`` and ``{ground_truth}``, sent as the user turn of the policy tokenizer's chat template. A
reply without a match of ``score_regex`` (or whose group is not a number) has no score: it gets
reward.error_score and is counted in reward/errors, as a failing rule reward is.

Deliberately simple: the judge is the policy being trained (a separate judge engine is refused at
config load), and its calls are one more generation on every rank, after the rollout's.
"""

from __future__ import annotations

import math
import re


def last_user_message(messages: list[dict[str, str]]) -> str:
    """What ``{prompt}`` stands for: the content of the prompt's last user message."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else (messages[-1]["content"] if messages else "")


def render_judge_prompt(template: str, *, prompt: str, response: str, ground_truth: str = "") -> str:
    """The template with the sample's fields (the config check allows only these three names)."""
    return template.format(prompt=prompt, response=response, ground_truth=ground_truth)


def parse_score(reply: str, pattern: re.Pattern[str]) -> float | None:
    """The first match's first group as a finite float, or None (no match, not a number)."""
    m = pattern.search(reply)
    if m is None or m.group(1) is None:
        return None
    try:
        value = float(m.group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None
