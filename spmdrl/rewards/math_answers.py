"""Math answers: extraction and equivalence with ``math-verify`` (boxed answers, fractions, LaTeX).

The rule for verl's math data sources (``reward.fn=auto`` dispatches them here, as verl's
``default_compute_score`` does; ``reward.fn=math`` uses it for any data). The ground truth is the
answer alone, as verl's preprocessing writes it (``\\frac{1}{2}``, ``34``, ``(1, 2]``); the response is
searched for its final answer (``\\boxed{...}`` first, then ``final answer is ...``, then a last plain
expression). Equal answers score 1.0, anything else 0.0: a wrong answer, no answer, an answer that does
not parse, or one that math-verify could not settle within its time limit. verl's rules differ by data
source (``math_dapo`` scores -1 for a wrong answer, ``lighteval/MATH`` compares normalized strings); one
rule, 0 or 1, keeps accuracy comparable across sources, and math-verify accepts the equal answers those
rules miss (``0.5`` for ``\\frac{1}{2}``, ``\\dfrac34`` for ``3/4``, ``x^2+2x+1`` for ``(x+1)^2``).

Where it runs. math-verify bounds each parse and comparison with ``signal.alarm``, which works only on a
process's main thread (elsewhere math-verify logs an error and returns nothing: every answer would score
0). And sympy has no bound of its own: ``9^{9^{9^9}}`` takes as long as the alarm lets it. So the rule is
registered untrusted: it runs in the reward sandbox's worker processes (spmdrl.rewards.sandbox), on their
main thread, with ``reward.timeout_s`` and ``reward.worker_memory_mb`` around it, also under
``reward.fn=auto``. :func:`compute_score` called off a main thread raises rather than scoring 0.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

from spmdrl.errors import ConfigError

# The extra that installs math-verify (pyproject.toml).
EXTRA = "math"
INSTALL_HINT = f'pip install "spmdrl[{EXTRA}]"  (or: pip install "math-verify[antlr4_9_3]")'
# verl 0.9.1's default_compute_score sends these data_source values to its math rules.
DATA_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math_dapo",
    "math",
    "math_dapo_reasoning",
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
    # verl takes every data_source starting with "aime"; these are the names its recipes use.
    "aime",
    "aime24",
    "aime25",
    "aime2024",
    "aime2025",
)
# Seconds math-verify may spend on each of its three steps (parse the truth, parse the response,
# compare): at most 6 s together, below reward.timeout_s's default (10 s), so a hard case scores 0
# without its worker being killed and restarted.
STEP_TIMEOUT_S = 2


class MathVerifyMissingError(ConfigError):
    """A math data source (or reward.fn=math) without the math-verify package installed."""


def is_installed() -> bool:
    try:
        return importlib.util.find_spec("math_verify") is not None
    except ImportError:  # an import hook that refuses it, or a broken install: not usable either way
        return False


def require_math_verify(why: str) -> None:
    """Raises :class:`MathVerifyMissingError` naming the extra to install, when math-verify is missing."""
    if not is_installed():
        raise MathVerifyMissingError(
            f"{why} needs the math-verify package, which is not installed; install the {EXTRA!r} extra: "
            f"{INSTALL_HINT}"
        )


def check_available(spec: str, data_sources: set[str]) -> None:
    """At start, before any model: ``reward.fn=math``, or ``auto`` on data with a math data source, needs
    math-verify."""
    spec = spec.strip()
    math_sources = sorted(data_sources & set(DATA_SOURCES))
    if spec == "math":
        require_math_verify("reward.fn=math")
    elif spec == "auto" and math_sources:
        require_math_verify(f"reward.fn=auto on data_source {', '.join(map(repr, math_sources))}")


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals ``ground_truth`` (math-verify), else 0.0.

    Must run on a main thread (math-verify's time limits are ``signal.alarm``); the reward sandbox's
    workers call it there.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "spmdrl.rewards.math_answers.compute_score runs math-verify, whose time limits work only on a "
            "process's main thread; score through spmdrl.rewards.sandbox.score_batch (reward.fn=math or "
            "auto), whose worker processes call it there"
        )
    require_math_verify("the math reward")
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # The truth is an answer alone; boxed, LaTeX extraction reads it whole (``\frac12``, ``(0, 1]``, ``3/4``).
    gold = _parse(parse, f"\\boxed{{{ground_truth}}}", (LatexExtractionConfig(),))
    if not gold:
        gold = _parse(parse, ground_truth, (ExprExtractionConfig(),))
    pred = _parse(parse, solution_str, (LatexExtractionConfig(), ExprExtractionConfig()))
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=STEP_TIMEOUT_S) else 0.0


def _parse(parse: Any, text: str, targets: tuple[Any, ...]) -> list[Any]:
    return parse(text, targets, parsing_timeout=STEP_TIMEOUT_S)
