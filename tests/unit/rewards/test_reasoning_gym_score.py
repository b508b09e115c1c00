"""reasoning-gym's rows scored by their task's own score_answer: right, wrong and malformed answers, the
entry's types kept through the data file, and reward.fn=auto sending them to the reward workers."""

from __future__ import annotations

import pytest

from spmdrl.data.reasoning_gym_task import ReasoningGymConfig, generate
from spmdrl.errors import ConfigError
from spmdrl.rewards import reasoning_gym_score
from spmdrl.rewards.reasoning_gym_score import compute_score, decode_entry, encode_entry
from spmdrl.rewards.registry import RewardInput, check_data_sources, load_reward_fn, rule_for
from spmdrl.rewards.sandbox import _untrusted_rule, score_batch

pytest.importorskip("reasoning_gym", reason='reasoning-gym is not installed: pip install -e ".[envs]"')


def rows(task: str, n: int = 3, **config: object) -> list[dict]:
    cfg = ReasoningGymConfig(train_size=0, test_size=n, config={task: config} if config else {})
    return generate(task, cfg)["test"]


def score(row: dict, response: str) -> dict[str, float]:
    return compute_score(response, row["data_source"], row["extra_info"])


# rearc's entries hold tuples (its grids) that its scorer compares as tuples: plain JSON would fail the
# right answer; the entry's tagged JSON keeps them.
@pytest.mark.parametrize("task", ["basic_arithmetic", "leg_counting", "rearc"])
def test_the_right_answer_scores_1_and_a_wrong_one_less(task: str) -> None:
    for row in rows(task):
        truth = row["reward_model"]["ground_truth"]
        right = score(row, f"Let me think.\n<answer>{truth}</answer>")
        assert right == {"score": 1.0, "answer_tag": 1.0, "scorer_raised": 0.0}
        wrong = score(row, "<answer>wrong 987654</answer>")
        assert 0.0 <= wrong["score"] < 1.0 and wrong["answer_tag"] == 1.0
        untagged = score(row, truth)  # the answer without the format: reasoning-gym finds none
        assert untagged == {"score": 0.0, "answer_tag": 0.0, "scorer_raised": 0.0}


def test_a_scorer_that_raises_on_the_answer_scores_0_and_is_counted() -> None:
    (row,) = rows("prime_factorization", 1)
    with pytest.raises(ValueError):  # reasoning-gym's own scorer, on an answer it cannot parse
        reasoning_gym_score.scoring_dataset("prime_factorization", "{}").score_answer(
            "abc", decode_entry(row["extra_info"]["entry"])
        )
    assert score(row, "<answer>abc</answer>") == {"score": 0.0, "answer_tag": 1.0, "scorer_raised": 1.0}
    assert score(row, f"<answer>{row['reward_model']['ground_truth']}</answer>")["score"] == 1.0


def test_the_entry_keeps_tuples_int_keys_and_numpy_scalars() -> None:
    import numpy as np

    entry = {"a": (1, (2, 3)), "b": {1: "x", (0, 1): [np.float64(0.5)]}, "c": [{"__tuple__": 1}]}
    back = decode_entry(encode_entry(entry))
    assert back == entry and isinstance(back["a"], tuple) and isinstance(back["a"][1], tuple)
    assert type(back["b"][(0, 1)][0]) is float


def test_auto_sends_reasoning_gym_rows_to_the_reward_workers() -> None:
    auto = load_reward_fn("auto")
    source = "reasoning_gym/basic_arithmetic"
    assert rule_for(source) is not None and rule_for("reasoning_gymx") is None
    assert _untrusted_rule(auto, source) == load_reward_fn("reasoning_gym")  # not inline: in a worker
    assert not load_reward_fn("reasoning_gym").trusted
    check_data_sources("auto", {source, "openai/gsm8k"})
    with pytest.raises(ConfigError, match=r"reasoning_gym/<task>"):
        check_data_sources("auto", {"reasoning-gym/lcm"})

    data = rows("basic_arithmetic", 2)
    inputs = [
        RewardInput(response, r["reward_model"]["ground_truth"], r["data_source"], r["extra_info"])
        for r in data
        for response in (
            f"<answer>{r['reward_model']['ground_truth']}</answer>",
            "<answer>x</answer>",
            "none",
        )
    ]
    # A row that did not come from the source (no entry): an error of that sample, named, not a crash.
    inputs.append(RewardInput("<answer>1</answer>", "1", source, {"split": "test"}))
    result = score_batch(auto, inputs, timeout_s=30.0, error_score=-1.0)
    assert result.scores_B.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, -1.0]
    assert result.num_errors == 1 and result.num_timeouts == 0
    assert result.extra["answer_tag"][:6] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
