"""The SFT dataset and collation (spmdrl/data/sft.py): string and message columns, limits, padding, masks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.data.parquet import DataError
from spmdrl.data.sft import SFTDataset, SFTExample, collate_sft
from tests.unit.data.chat_data import chatml, write


def sft_dataset(path: Path, tokenizer, **kw) -> SFTDataset:
    args = dict(
        prompt_key="prompt",
        response_key="response",
        max_prompt_length=256,
        max_response_length=64,
        overlong="filter",
    )
    return SFTDataset([path], tokenizer, **(args | kw))


def test_sft_string_columns_tokenize_prompt_and_response_apart(tmp_path, tokenizer):
    prompts = ["what is 12 + 30?", "hello"]
    responses = ["the answer is 42.", "world"]
    path = write(tmp_path / "sft.parquet", {"prompt": prompts, "response": responses})
    ds = sft_dataset(path, tokenizer)
    eos = tokenizer.eos_token_id
    for i in range(2):
        ex = ds[i]
        prompt_text = chatml([{"role": "user", "content": prompts[i]}])
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        response_ids = tokenizer.encode(responses[i], add_special_tokens=False)
        assert ex.input_ids == prompt_ids + response_ids + [eos]
        assert ex.loss_mask == [0] * len(prompt_ids) + [1] * (len(response_ids) + 1)
        # The masked tokens decode to exactly the response and the eos token.
        masked = [t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
        assert tokenizer.decode(masked) == responses[i] + "<|im_end|>"
        assert tokenizer.decode(ex.input_ids) == prompt_text + responses[i] + "<|im_end|>"


def test_sft_message_columns_extend_the_prompt(tmp_path, tokenizer):
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 + 2?"}]
    response = [
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "wrong, try again"},
        {"role": "assistant", "content": "3"},
    ]
    path = write(tmp_path / "sft_msgs.parquet", {"prompt": [prompt], "response": [response]})
    ex = sft_dataset(path, tokenizer)[0]
    masked = [t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
    unmasked = [t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if not m]
    assert tokenizer.decode(masked) == "3<|im_end|>"
    # Earlier turns of the response column are part of the (unmasked) prompt conversation.
    assert tokenizer.decode(unmasked) == chatml(prompt + response[:2])


def test_sft_overlong_limits(tmp_path, tokenizer):
    responses = ["hello world", "hello world " * 30, "7"]
    path = write(tmp_path / "sft_long.parquet", {"prompt": ["q"] * 3, "response": responses})
    n_long = len(tokenizer.encode(responses[1], add_special_tokens=False)) + 1
    ds = sft_dataset(path, tokenizer, max_response_length=n_long - 1)
    assert ds.num_filtered == 1 and len(ds) == 2
    # The eos token counts toward the response limit: n_long - 1 response tokens + eos fit exactly.
    assert sft_dataset(path, tokenizer, max_response_length=n_long).num_filtered == 0
    with pytest.raises(DataError, match=r"sft_long\.parquet row 1: the response.*data\.max_response_length"):
        sft_dataset(path, tokenizer, max_response_length=n_long - 1, overlong="error")
    with pytest.raises(DataError, match=r"row 0: .*data\.max_prompt_length"):
        sft_dataset(path, tokenizer, max_prompt_length=3, overlong="error")


def test_collate_pads_right_and_masks_padding():
    a = SFTExample(input_ids=[5, 6, 7, 8, 9], loss_mask=[0, 0, 0, 1, 1])
    b = SFTExample(input_ids=[5, 6, 7], loss_mask=[0, 1, 1])
    batch = collate_sft([a, b], pad_id=0, pad_to_multiple_of=4)
    assert batch.input_ids_BT.shape == (2, 8) and batch.input_ids_BT.dtype == torch.long
    assert batch.input_ids_BT[1].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert batch.attention_mask_BT.tolist() == [[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]
    assert batch.loss_mask_BT.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert batch.position_ids_BT[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert batch.position_ids_BT[1, :3].tolist() == [0, 1, 2]
    assert collate_sft([a, b], pad_id=0).input_ids_BT.shape == (2, 5)


def test_loss_mask_shift_convention(tmp_path, tokenizer):
    """logits[:, t] predicts input_ids[:, t+1] and counts iff loss_mask[:, t+1]: the last prompt position
    (the template's "assistant\\n") predicts the first response token, which is masked in."""
    path = write(
        tmp_path / "sft.parquet", {"prompt": ["what is 12 + 30?", "hi"], "response": ["42", "7 plus 5"]}
    )
    ds = sft_dataset(path, tokenizer)
    batch = collate_sft([ds[0], ds[1]], pad_id=tokenizer.pad_token_id)
    for b in range(2):
        n_prompt = len(
            tokenizer.encode(
                chatml([{"role": "user", "content": ["what is 12 + 30?", "hi"][b]}]), add_special_tokens=False
            )
        )
        mask = batch.loss_mask_BT[b]
        assert mask[n_prompt - 1] == 0 and mask[n_prompt] == 1
        first_response = tokenizer.decode(batch.input_ids_BT[b, n_prompt : n_prompt + 1])
        assert ["42", "7 plus 5"][b].startswith(first_response)
        # The targets that count, shifted: exactly the response tokens and the eos.
        targets = batch.input_ids_BT[b, 1:][mask[1:] == 1]
        assert tokenizer.decode(targets) == ["42", "7 plus 5"][b] + "<|im_end|>"
