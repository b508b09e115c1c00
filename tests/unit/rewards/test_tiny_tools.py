"""The built-in tool task's reward (spmdrl/rewards/tiny_tools.py): the last answer, registered by name."""

from __future__ import annotations

from spmdrl.rewards import tiny_tools
from spmdrl.rewards.registry import auto_score, check_data_sources, load_reward_fn

# ------------------------------------------------------------------------------------- reward


def test_reward_reads_the_last_answer():
    score = tiny_tools.compute_score
    assert score("#### 930453", "930453") == 1.0
    assert score("<tool_call>...</tool_call>\ntool\n930453\nassistant\n#### 930453", "930453") == 1.0
    assert score("#### 930,453", "930453") == 1.0
    assert score("#### 930453 is it", "930453") == 1.0
    assert score("#### 930000", "930453") == 0.0
    assert score("#### 930453\n#### 1", "930453") == 0.0  # the last answer counts
    assert score("930453", "930453") == 0.0  # the tool's result alone is not an answer
    assert score("", "930453") == 0.0
    assert score("#### 9304530", "930453") == 0.0


def test_reward_is_registered_by_name_and_data_source():
    fn = load_reward_fn("tiny_tools")
    assert fn.trusted
    assert fn("#### 6", "6", data_source="tiny_tools", extra_info={}) == 1.0
    assert auto_score("#### 6", "6", data_source="tiny_tools", extra_info={"num_turns": 2}) == 1.0
    assert auto_score("#### 7", "6", data_source="tiny_tools", extra_info={}) == 0.0
    check_data_sources("auto", {"tiny_tools"})
