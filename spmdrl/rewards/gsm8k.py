"""GSM8K answer extraction and scoring, compatible with verl's ``gsm8k.compute_score``.

Compatibility: with the defaults (``method="strict"``, ``format_score=0.0``, ``score=1.0``) and a
ground truth as verl's GSM8K preprocessing writes it (the number after ``####``, commas removed),
:func:`compute_score` gives the same score as verl for every response, quirks included:

- only the last 300 characters are searched (a cap that keeps the regex cheap on long responses);
- strict takes the last ``#### <number>``; the number must follow ``#### `` directly, so
  ``#### $18`` is not an answer, and ``#### 18.`` extracts ``18.``, which is not ``18``.

Two places differ from verl, both only make more answers match:

- the ground truth is normalized like the answer (whitespace, commas and ``$`` removed), so a
  ground truth written ``1,000`` matches ``#### 1000``;
- ``flexible`` strips commas and a trailing ``.`` from the candidate and skips candidates without a
  digit (verl keeps both, so ``The answer is 18.`` extracts ``18.`` there and ``18`` here).
"""

from __future__ import annotations

import re

# verl searches only the tail of the response; the answer is expected at the end.
SOLUTION_CLIP_CHARS = 300

_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER_RE = re.compile(r"-?[0-9.,]+")

METHODS = ("strict", "flexible")


def _normalize(answer: str) -> str:
    return answer.strip().replace(",", "").replace("$", "")


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The final numeric answer in ``text``, normalized (commas and ``$`` removed), or None.

    ``strict``: the number after the last ``#### ``. ``flexible``: the last number anywhere.
    """
    if method not in METHODS:
        raise ValueError(f"unknown GSM8K extraction method {method!r}; use one of {', '.join(METHODS)}")
    tail = text[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT_RE.findall(tail)
        return _normalize(matches[-1]) if matches else None
    for candidate in reversed(_NUMBER_RE.findall(tail)):
        # "1,000." at the end of a sentence is the number 1000; "." or "," alone is punctuation.
        answer = _normalize(candidate).rstrip(".")
        if any(ch.isdigit() for ch in answer):
            return answer
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if an answer was
    extracted but is wrong, 0.0 if none was found. Answers are compared as normalized strings."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == _normalize(str(ground_truth)) else float(format_score)
