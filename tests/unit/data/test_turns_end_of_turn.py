"""Where a response ends (spmdrl.data.turns.end_of_turn_ids) for each family's tokenizer and chat template,
and the SFT demonstrations that end with that token (spmdrl.data.sft)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdrl.data.sft import SFTDataset
from spmdrl.data.turns import end_of_turn_ids
from spmdrl.testing.models import FAMILY_SPECS, family_tokenizer


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {name: family_tokenizer(spec) for name, spec in FAMILY_SPECS.items()}


@pytest.mark.parametrize("family", list(FAMILY_SPECS))
def test_the_template_end_of_turn_when_it_is_not_eos(tokenizers: dict, family: str) -> None:
    tok, spec = tokenizers[family], FAMILY_SPECS[family]
    ids = end_of_turn_ids(tok)
    if spec.end_of_turn:  # Llama 3's <|eot_id|>, Gemma's <end_of_turn>: not the eos
        assert tok.convert_ids_to_tokens(ids) == [spec.end_of_turn]
        assert ids != [tok.eos_token_id]
    else:  # ChatML instruct (<|im_end|> is the eos), Mistral (an answer ends with </s>)
        assert ids == []


def test_no_template_or_no_end_token_means_no_extra_stop(tokenizers: dict) -> None:
    tok = family_tokenizer(FAMILY_SPECS["llama3"])
    tok.chat_template = None
    assert end_of_turn_ids(tok) == []
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # ends turns with nothing
    assert end_of_turn_ids(tok) == []


@pytest.mark.parametrize("family", ["llama3", "gemma2", "qwen2"])
def test_sft_demonstrations_end_with_the_turn_end(tmp_path: Path, tokenizers: dict, family: str) -> None:
    """With a system prompt in the prompt column; the response's last id is the template's turn end."""
    tok = tokenizers[family]
    prompt = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 3 + 4?"},
    ]
    pq.write_table(pa.table({"prompt": [prompt], "response": ["7"]}), tmp_path / "sft.parquet")
    ds = SFTDataset(
        [tmp_path / "sft.parquet"],
        tok,
        prompt_key="prompt",
        response_key="response",
        max_prompt_length=128,
        max_response_length=16,
        overlong="filter",
    )
    ex = ds[0]
    end = (end_of_turn_ids(tok) or [tok.eos_token_id])[0]
    assert ex.input_ids[-1] == end and ex.loss_mask[-1] == 1
    # The trained ids are the answer and the turn end, as the template writes the assistant's turn.
    trained = [i for i, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
    full = tok.apply_chat_template([*prompt, {"role": "assistant", "content": "7"}], tokenize=False)
    assert full.startswith(tok.decode(ex.input_ids[: len(ex.input_ids) - len(trained)]))
    assert tok.decode(trained) in full and "Answer with a number." in tok.decode(ex.input_ids)
