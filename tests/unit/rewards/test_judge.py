"""spmdrl/rewards/judge.py: the judge's prompt template and the parsing of its score; and the token ids
spmdrl/rl/judge.py sends (the engine call itself runs in tests/integration/test_reward_models.py)."""

from __future__ import annotations

import re

import pytest

from spmdrl.config import JudgeConfig
from spmdrl.rewards.judge import last_user_message, parse_score, render_judge_prompt
from spmdrl.rl.judge import Judge

DEFAULT = re.compile(JudgeConfig().score_regex)


def test_render_fills_the_three_fields() -> None:
    text = render_judge_prompt(
        "Q: {prompt}\nA: {response}\nTruth: {ground_truth}",
        prompt="1+1?",
        response="#### 2",
        ground_truth="2",
    )
    assert text == "Q: 1+1?\nA: #### 2\nTruth: 2"
    # The default template has {prompt} and {response}, no ground truth.
    text = render_judge_prompt(JudgeConfig().template, prompt="P?", response="R.", ground_truth="secret")
    assert "P?" in text and "R." in text and "secret" not in text


@pytest.mark.parametrize(
    "reply, score",
    [
        ("Score: 7", 7.0),
        ("I think... score: 8.5, maybe Score: 2", 8.5),  # the first match
        ("Score:-1", -1.0),
        ("The answer is fine", None),  # no match
        ("Score: ten", None),
        ("", None),
    ],
)
def test_parse_score(reply: str, score: float | None) -> None:
    assert parse_score(reply, DEFAULT) == score


def test_parse_score_custom_regex_and_non_numbers() -> None:
    assert parse_score("<grade>0.25</grade>", re.compile(r"<grade>(.*?)</grade>")) == 0.25
    assert parse_score("<grade>good</grade>", re.compile(r"<grade>(.*?)</grade>")) is None
    assert parse_score("<grade>nan</grade>", re.compile(r"<grade>(.*?)</grade>")) is None  # not finite
    assert parse_score("x", re.compile(r"(y)?x")) is None  # an optional group that did not take part


def test_last_user_message() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert last_user_message(msgs) == "b"
    assert last_user_message([{"role": "system", "content": "s"}]) == "s"


def test_prompt_ids_are_the_chat_templated_user_turn_cut_to_the_context() -> None:
    from spmdrl.models.load import load_tokenizer
    from spmdrl.models.tiny import default_cache_dir, ensure_tiny_model

    tok = load_tokenizer(ensure_tiny_model(default_cache_dir()))
    cfg = JudgeConfig(enable=True, template="Judge {response} for {prompt}", max_tokens=8)
    judge = Judge(cfg, engine=None, tokenizer=tok, max_model_len=4096, error_score=0.0)  # type: ignore[arg-type]
    ids = judge.prompt_ids([[{"role": "user", "content": "Q1"}]], ["R1"], ["t"])
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Judge R1 for Q1"}], add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(ids[0]) == text
    short = Judge(cfg, engine=None, tokenizer=tok, max_model_len=12, error_score=0.0)  # type: ignore[arg-type]
    assert short.prompt_ids([[{"role": "user", "content": "Q1"}]], ["R1"], ["t"])[0] == ids[0][-4:]
