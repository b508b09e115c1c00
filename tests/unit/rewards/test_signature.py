"""spmdrl/rewards/signature.py: spmdrl's and verl's reward signatures, told apart when the function loads,
and a verl function run through reward.fn and the sandbox's real worker processes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from spmdrl.errors import ConfigError
from spmdrl.rewards.registry import REWARD_FNS, RewardInput, load_reward_fn, register_reward_fn
from spmdrl.rewards.sandbox import score_batch
from spmdrl.rewards.signature import CallStyle, call_style


def spmdrl_style(response, ground_truth, *, data_source, extra_info):
    return 1.0


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def verl_reordered(ground_truth, solution_str, data_source, extra_info=None):
    # verl calls by keyword; spmdrl's positional call would bind too, swapping response and ground truth.
    return 1.0


def takes_anything(*args, **kwargs):
    return 1.0


def neither(solution, truth):
    return 1.0


@pytest.mark.parametrize(
    ("fn", "style"),
    [
        (spmdrl_style, CallStyle.SPMDRL),
        (verl_style, CallStyle.VERL),
        (verl_reordered, CallStyle.VERL),
        (takes_anything, CallStyle.SPMDRL),
    ],
)
def test_call_style_from_the_signature(fn, style) -> None:
    assert call_style(fn) is style


def test_neither_signature_names_both() -> None:
    with pytest.raises(TypeError, match=r"neither spmdrl's, score\(response.*nor verl's, compute_score\("):
        call_style(neither)


VERL_FILE = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # verl's convention: a dict with "score" and extra keys, text among them (math_dapo's "pred").
        acc = solution_str.strip() == ground_truth
        return {
            "score": 1.0 if acc else 0.0,
            "acc": acc,
            "length": float(len(solution_str)),
            "pred": solution_str.strip(),
            "source_ok": float(data_source == "my/source" and extra_info["index"] >= 0),
        }


    def wrong(solution, truth):
        return 0.0
    """
)


@pytest.fixture
def verl_file(tmp_path: Path) -> Path:
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_FILE)
    return path


def test_verl_function_by_path_scores_in_workers(verl_file: Path) -> None:
    fn = load_reward_fn(f"{verl_file}:compute_score")
    assert fn.style is CallStyle.VERL and not fn.trusted
    inputs = [RewardInput(r, "19", "my/source", {"index": i}) for i, r in enumerate(["19", " 7", "19 "])]
    # The workers are fresh interpreters: they re-load the function by its spec and detect its style again.
    result = score_batch(fn, inputs, timeout_s=10, error_score=-1.0)
    assert result.scores_B.tolist() == [1.0, 0.0, 1.0] and result.num_errors == 0
    # Numeric extras (bool included) are kept per sample; the text one ("pred") is left out.
    assert result.extra == {"acc": [1.0, 0.0, 1.0], "length": [2.0, 2.0, 3.0], "source_ok": [1.0, 1.0, 1.0]}


def test_neither_signature_is_a_config_error_at_load(verl_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"reward.fn=.*wrong.*neither spmdrl's.*nor verl's"):
        load_reward_fn(f"{verl_file}:wrong")


def test_a_registered_verl_function_is_called_verls_way() -> None:
    seen: list[dict] = []

    def my_verl_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth})
        return 0.5

    register_reward_fn("test_verl_style", trusted=True)(my_verl_score)
    try:
        fn = load_reward_fn("test_verl_style")
        assert fn.style is CallStyle.VERL
        result = score_batch(fn, [RewardInput("the answer", "42", "src", {})], timeout_s=5, error_score=-1.0)
    finally:
        REWARD_FNS.unregister("test_verl_style")
    assert result.scores_B.tolist() == [0.5]
    assert seen == [{"data_source": "src", "solution_str": "the answer", "ground_truth": "42"}]


def test_registering_a_function_of_neither_signature_fails() -> None:
    with pytest.raises(TypeError, match="neither spmdrl's"):
        register_reward_fn("test_neither")(neither)
    assert "test_neither" not in REWARD_FNS
