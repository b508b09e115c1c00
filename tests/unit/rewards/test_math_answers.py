"""The math rule (spmdrl/rewards/math_answers.py): math-verify on hand-written answers in each of verl's math
data sources' formats, its dispatch by reward.fn=auto into the sandbox's workers (where math-verify's
signal-based time limits work, from any calling thread), and the start-up check for the `math` extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("math_verify", reason='math-verify is not installed: pip install -e ".[math]"')

from spmdrl.rewards import math_answers  # noqa: E402
from spmdrl.rewards.math_answers import MathVerifyMissingError, compute_score  # noqa: E402
from spmdrl.rewards.registry import (  # noqa: E402
    DATA_SOURCE_FNS,
    RewardInput,
    check_data_sources,
    load_reward_fn,
)
from spmdrl.rewards.sandbox import score_batch  # noqa: E402

# (data_source, response, ground truth as verl's preprocessing writes it, expected score)
CASES = [
    # MATH (lighteval / MATH-lighteval / MATH-500): the solution's \boxed{} content is the ground truth.
    ("lighteval/MATH", "So $x = \\frac{1}{2}$ and the answer is $\\boxed{\\frac12}$.", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "Dividing, we get $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
    ("lighteval/MATH", "Dividing, we get $\\boxed{\\frac{2}{3}}$.", "\\frac{1}{2}", 0.0),
    ("DigitalLearningGmbH/MATH-lighteval", "The domain is $\\boxed{(-\\infty, 3]}$.", "(-\\infty,3]", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "The domain is $\\boxed{(-\\infty, 3)}$.", "(-\\infty,3]", 0.0),
    ("HuggingFaceH4/MATH-500", "Simplifying, $\\boxed{2\\sqrt{3}}$.", "\\sqrt{12}", 1.0),
    ("HuggingFaceH4/MATH-500", "Expanding: $\\boxed{x^2+2x+1}$", "(x+1)^2", 1.0),
    ("HuggingFaceH4/MATH-500", "The choice is $\\boxed{\\text{(B)}}$", "\\text{(C)}", 0.0),
    # DAPO: plain integer ground truths, the response ends "Answer: <n>".
    ("math_dapo", "Adding, 12 + 22 = 34.\nAnswer: 34", "34", 1.0),
    ("math_dapo", "Adding, 12 + 23 = 35.\nAnswer: 35", "34", 0.0),
    ("math_dapo", "Answer: \\frac{3}{4}", "0.75", 1.0),
    ("aime24", "So the answer is $\\boxed{033}$.", "33", 1.0),
    # NuminaMath: LaTeX ground truths.
    ("numina_olympiads", "Hence the minimum is $\\boxed{\\dfrac{\\pi}{4}}$.", "\\frac{\\pi}{4}", 1.0),
    ("numina_cn_k12", "Therefore the set is $\\boxed{\\{1, 2\\}}$", "\\{2,1\\}", 1.0),
    ("numina_cn_k12", "The final answer is $3/4$", "\\frac{3}{4}", 1.0),
    ("numina_synthetic_math", "So $x = 5$, $y = 7$ and the sum is $\\boxed{12}$.", "12", 1.0),
    ("numina_aops_forum", "The sum is $\\boxed{13}$.", "12", 0.0),
    # Malformed completions: no answer, an unclosed box, an empty fraction.
    ("lighteval/MATH", "", "5", 0.0),
    ("lighteval/MATH", "I am not sure how to finish this.", "5", 0.0),
    ("lighteval/MATH", "The answer is \\boxed{", "5", 0.0),
    ("lighteval/MATH", "The answer is \\boxed{\\frac{1}{}}", "5", 0.0),
]


@pytest.mark.parametrize(("data_source", "response", "truth", "expected"), CASES)
def test_hand_written_answers(data_source: str, response: str, truth: str, expected: float) -> None:
    assert compute_score(response, truth) == expected


def test_every_verl_math_source_dispatches_to_the_math_rule() -> None:
    math_rule = load_reward_fn("math")
    assert not math_rule.trusted  # sympy has no bound: it runs in the sandbox's workers
    for source in math_answers.DATA_SOURCES:
        assert DATA_SOURCE_FNS[source] is math_rule.fn, source


def _inputs() -> list[RewardInput]:
    # Mixed with a GSM8K sample, which auto still scores inline.
    return [RewardInput(r, t, ds, {}) for ds, r, t, _ in CASES] + [
        RewardInput("so #### 18", "18", "openai/gsm8k", {})
    ]


def _expected() -> list[float]:
    return [e for *_, e in CASES] + [1.0]


def test_auto_scores_math_sources_in_workers_on_any_thread() -> None:
    """math-verify's limits are signal.alarm, refused off a main thread; auto hands math samples to worker
    processes, so a batch scored from another thread still gets every score right."""
    got: dict[str, object] = {}

    def score_in_thread() -> None:
        try:
            # Called directly off the main thread, the rule refuses rather than scoring 0 silently.
            compute_score("\\boxed{1}", "1")
        except RuntimeError as e:
            got["direct"] = str(e)
        got["batch"] = score_batch(load_reward_fn("auto"), _inputs(), timeout_s=30.0, error_score=-1.0)

    thread = threading.Thread(target=score_in_thread)
    thread.start()
    thread.join(timeout=300)
    assert "main thread" in str(got["direct"])
    result = got["batch"]
    assert result.scores_B.tolist() == _expected()  # type: ignore[attr-defined]
    assert result.num_errors == 0 and result.num_timeouts == 0  # type: ignore[attr-defined]


def test_a_runaway_answer_scores_zero_within_math_verifys_limit() -> None:
    """9^(9^(9^9)) sends sympy off for ever; in a worker, math-verify's alarm stops it and the sample scores
    0 without its worker being killed (no reward error, no timeout), well inside reward.timeout_s."""
    inputs = [
        RewardInput("So it is $\\boxed{9^{9^{9^{9}}}}$.", "3", "math_dapo", {}),
        RewardInput("So it is $\\boxed{3}$.", "3", "math_dapo", {}),
    ]
    start = time.monotonic()
    result = score_batch(load_reward_fn("auto"), inputs, timeout_s=20.0, error_score=-1.0)
    assert result.scores_B.tolist() == [0.0, 1.0]
    assert result.num_errors == 0 and result.num_timeouts == 0
    assert time.monotonic() - start < 20.0


def test_check_at_start_passes_when_installed() -> None:
    check_data_sources("auto", {"lighteval/MATH", "openai/gsm8k"})
    check_data_sources("math", {"anything"})


def test_missing_package_fails_at_start_naming_the_extra() -> None:
    """The package is installed here, so a child process hides it (an import hook: a fake for "not
    installed", which cannot be real in a shared environment) and runs the start-up check."""
    code = textwrap.dedent(
        """
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "math_verify":
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Hide())
        from spmdrl.rewards.registry import check_data_sources
        check_data_sources("auto", {"openai/gsm8k"})  # no math source: no need
        for spec, sources in (("auto", {"openai/gsm8k", "math_dapo"}), ("math", {"x"})):
            try:
                check_data_sources(spec, sources)
            except Exception as e:
                print(type(e).__name__, e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    assert lines[0].startswith(MathVerifyMissingError.__name__) and "'math_dapo'" in lines[0]
    assert "reward.fn=math" in lines[1]
    for line in lines:
        assert 'pip install "spmdrl[math]"' in line
