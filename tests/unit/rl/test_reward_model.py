"""spmdrl/rl/reward_model.py: the reward model's files, its chat template, batched scoring (one
process, a plain transformers module: FSDP2's sharded build is tested by the integration tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from spmdrl.errors import ConfigError
from spmdrl.models.load import load_tokenizer
from spmdrl.rewards.reward_model_path import check_reward_model_dir
from spmdrl.rl.reward_model import (
    RewardModel,
    encode_for_rm,
    render_for_rm,
    sequence_scores,
)

MESSAGES = [{"role": "user", "content": "Tom has 2 apples and gets 3 more. How many apples does Tom have?"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spmdrl.models.tiny import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def rm_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny backbone with a random scalar head, saved as a sequence-classification model."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_dir, num_labels=1)
    tok = load_tokenizer(tiny_dir)
    config.pad_token_id = tok.pad_token_id
    out = tmp_path_factory.mktemp("rm")
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_render_uses_the_rms_template_with_the_response_as_assistant_turn(rm_dir: Path) -> None:
    tok = load_tokenizer(rm_dir)
    text = render_for_rm(tok, MESSAGES, "2 + 3 = 5\n#### 5")
    expected = tok.apply_chat_template(
        [*MESSAGES, {"role": "assistant", "content": "2 + 3 = 5\n#### 5"}], tokenize=False
    )
    assert text == expected
    assert text.index(MESSAGES[0]["content"]) < text.index("#### 5")
    # A complete turn: no generation prompt after the response.
    prompt_only = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt_only) and len(text) > len(prompt_only)


def test_encode_keeps_the_end_when_cut(rm_dir: Path) -> None:
    tok = load_tokenizer(rm_dir)
    full, cut = encode_for_rm(tok, [MESSAGES], ["#### 5"], max_length=10_000)
    short, cut_short = encode_for_rm(tok, [MESSAGES], ["#### 5"], max_length=7)
    assert cut == 0 and cut_short == 1
    assert short[0] == full[0][-7:]


def test_batched_scores_equal_one_by_one(rm_dir: Path) -> None:
    """Micro-batching and right padding change no score: each is read at its own row's last token."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = load_tokenizer(rm_dir)
    responses = ["#### 5", "2 + 3 = 5\n#### 5", "2 + 3 = 6\n#### 6 and some more words here", "no"]
    messages = [MESSAGES] * len(responses)
    scorer = RewardModel(model, tok, micro_batch_size=3, max_length=512, device=torch.device("cpu"))
    batched = scorer.score(messages, responses)
    one_by_one = torch.cat(
        [
            RewardModel(model, tok, micro_batch_size=1, max_length=512, device=torch.device("cpu")).score(
                [m], [r]
            )
            for m, r in zip(messages, responses, strict=True)
        ]
    )
    assert batched.shape == (4,) and batched.dtype == torch.float32
    assert torch.allclose(batched, one_by_one, atol=1e-5)
    assert batched.unique().numel() == 4  # the responses score differently
    # The hook reads the head at the last real token: transformers' own pooling agrees on an unpadded row.
    ids = torch.tensor([encode_for_rm(tok, [MESSAGES], ["#### 5"], 512)[0][0]])
    with torch.no_grad():
        hf = model(input_ids=ids).logits[0, 0]
        ours = sequence_scores(model, ids, torch.ones_like(ids))[0]
    assert float(ours) == pytest.approx(float(hf), abs=1e-5)


def test_reward_model_dir_checks(tiny_dir: Path, rm_dir: Path, tmp_path: Path) -> None:
    assert check_reward_model_dir(str(rm_dir)) == rm_dir
    with pytest.raises(ConfigError, match="not a \\*ForSequenceClassification"):
        check_reward_model_dir(str(tiny_dir))  # a causal LM
    with pytest.raises(ConfigError, match="no config.json"):
        check_reward_model_dir(str(tmp_path / "nowhere"))
    two = tmp_path / "two"
    two.mkdir()
    config = json.loads((rm_dir / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(ConfigError, match="2 labels"):
        check_reward_model_dir(str(two))
