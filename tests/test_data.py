"""Parquet reading, RL prompt and SFT datasets, and SFT collation."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from spmdrl.data.parquet import DataError, read_table
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sft import SFTDataset, SFTExample, collate_sft

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE with ChatML special tokens; trained in milliseconds, so no download."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["user assistant system what is 12 + 30? the answer is 42.", "hello world, answer: 7 plus 5"]
    tok.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def chatml(messages: list[dict[str, str]]) -> str:
    """The ChatML text a conversation should render to, written out by hand for the checks."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def verl_rows(n: int) -> dict[str, list]:
    return {
        "data_source": ["tiny/add"] * n,
        "prompt": [
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"what is {i} + {i}?"}]
            for i in range(n)
        ],
        "ability": ["math"] * n,
        "reward_model": [{"ground_truth": str(2 * i), "style": "rule"} for i in range(n)],
        "extra_info": [{"index": i, "split": "train"} for i in range(n)],
    }


def write(path: Path, columns: dict[str, list]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# ---------------------------------------------------------------- RL prompts


def test_prompt_dataset_reads_verl_schema(tmp_path, tokenizer):
    path = write(tmp_path / "train.parquet", verl_rows(5))
    ds = PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=512, overlong="filter")
    assert len(ds) == 5 and ds.num_filtered == 0
    ex = ds[3]
    assert ex.index == 3
    assert ex.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 3 + 3?"},
    ]
    assert ex.ground_truth == "6"
    assert ex.data_source == "tiny/add"
    assert ex.extra_info == {"index": 3, "split": "train"}
    # The template's special tokens appear once each: encoding did not add another bos/eos.
    assert tokenizer.decode(ex.prompt_ids) == chatml(ex.messages)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ex.prompt_ids.count(im_start) == 3 and ex.prompt_ids[0] == im_start
    with pytest.raises(IndexError):
        ds[5]


def test_prompt_dataset_concatenates_files_and_accepts_string_prompts(tmp_path, tokenizer):
    def with_question(n: int, text: str) -> dict[str, list]:
        rows = verl_rows(n)
        del rows["prompt"]
        rows["question"] = [f"{text} {i}" for i in range(n)]
        return rows

    a = write(tmp_path / "a.parquet", with_question(2, "first"))
    b = write(tmp_path / "b.parquet", with_question(3, "second"))
    ds = PromptDataset([a, b], tokenizer, prompt_key="question", max_prompt_length=512, overlong="filter")
    assert len(ds) == 5
    assert ds[4].messages == [{"role": "user", "content": "second 2"}]
    assert tokenizer.decode(ds[0].prompt_ids) == chatml([{"role": "user", "content": "first 0"}])
    # Files whose prompt column holds different kinds of value cannot be read together.
    messages_file = write(tmp_path / "messages.parquet", verl_rows(2))
    string_file = write(tmp_path / "strings.parquet", {"prompt": ["text"]})
    with pytest.raises(DataError, match="same column types"):
        read_table([messages_file, string_file], ["prompt"])


def test_ground_truth_that_is_not_a_string_is_converted(tmp_path, tokenizer):
    rows = verl_rows(2)
    rows["reward_model"] = [{"ground_truth": [1, 2], "style": "rule"}, {"ground_truth": [3], "style": "rule"}]
    path = write(tmp_path / "list_truth.parquet", rows)
    ds = PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=512, overlong="filter")
    assert ds[0].ground_truth == "[1, 2]"


def test_overlong_prompts_are_filtered_or_rejected(tmp_path, tokenizer):
    rows = verl_rows(6)
    for i in (1, 4):
        rows["prompt"][i] = [{"role": "user", "content": "what is 12 + 30? " * 20}]
    path = write(tmp_path / "long.parquet", rows)
    short_len = len(tokenizer.encode(chatml(rows["prompt"][0]), add_special_tokens=False))
    long_len = len(tokenizer.encode(chatml(rows["prompt"][1]), add_special_tokens=False))
    assert short_len < long_len
    limit = (short_len + long_len) // 2

    ds = PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=limit, overlong="filter")
    assert ds.num_filtered == 2 and len(ds) == 4
    # The kept prompts are rows 0, 2, 3, 5 in order, renumbered 0..3.
    assert [ds[i].ground_truth for i in range(4)] == ["0", "4", "6", "10"]
    assert [ds[i].index for i in range(4)] == [0, 1, 2, 3]

    with pytest.raises(DataError) as err:
        PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=limit, overlong="error")
    msg = str(err.value)
    assert "long.parquet row 1" in msg and "data.max_prompt_length" in msg and str(long_len) in msg

    # A limit equal to a prompt's length keeps it.
    ds = PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=long_len, overlong="filter")
    assert ds.num_filtered == 0


def test_error_rows_are_counted_within_their_file(tmp_path, tokenizer):
    a = write(tmp_path / "first.parquet", verl_rows(3))
    rows = verl_rows(3)
    rows["prompt"][2] = [{"role": "user", "content": "hello world " * 50}]
    b = write(tmp_path / "second.parquet", rows)
    with pytest.raises(DataError, match=r"second\.parquet row 2"):
        PromptDataset([a, b], tokenizer, prompt_key="prompt", max_prompt_length=40, overlong="error")


# ---------------------------------------------------------------- file and cell errors


def test_missing_column_names_file_column_and_key(tmp_path, tokenizer):
    path = write(tmp_path / "train.parquet", verl_rows(2))
    with pytest.raises(DataError) as err:
        PromptDataset([path], tokenizer, prompt_key="question", max_prompt_length=64, overlong="filter")
    msg = str(err.value)
    assert "train.parquet" in msg and "'question'" in msg and "data.prompt_key" in msg
    for have in ("prompt", "reward_model", "data_source", "extra_info"):
        assert have in msg


def test_missing_and_non_parquet_files(tmp_path, tokenizer):
    with pytest.raises(DataError, match="nope.parquet does not exist"):
        read_table([tmp_path / "nope.parquet"], ["prompt"])
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all\n" * 10)
    with pytest.raises(DataError, match="garbage.parquet is not a readable parquet file"):
        PromptDataset([garbage], tokenizer, prompt_key="prompt", max_prompt_length=64, overlong="filter")
    with pytest.raises(DataError, match="no data files"):
        read_table([], ["prompt"])


def test_empty_file_is_rejected(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], type=pa.string())}), empty)
    with pytest.raises(DataError, match="empty.parquet has no rows"):
        read_table([empty], ["prompt"])


def test_wrong_cell_types_name_file_row_and_column(tmp_path, tokenizer):
    rows = verl_rows(3)
    rows["prompt"] = [[{"role": "user", "content": "ok"}], [], [{"role": "user", "content": "ok"}]]
    path = write(tmp_path / "cells.parquet", rows)
    with pytest.raises(DataError, match=r"cells\.parquet row 1: column 'prompt'"):
        PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=64, overlong="filter")

    rows = verl_rows(2)
    rows["n"] = [1, 2]
    path = write(tmp_path / "numbers.parquet", rows)
    with pytest.raises(DataError, match=r"numbers\.parquet row 0: column 'n'.*got int 1"):
        PromptDataset([path], tokenizer, prompt_key="n", max_prompt_length=64, overlong="filter")

    rows = verl_rows(2)
    rows["reward_model"] = [{"ground_truth": "1", "style": "rule"}, {"ground_truth": None, "style": "rule"}]
    path = write(tmp_path / "truth.parquet", rows)
    with pytest.raises(DataError, match=r"truth\.parquet row 1: column reward_model"):
        PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=64, overlong="filter")

    with pytest.raises(DataError, match=r"row 0: the last message in column 'response'"):
        SFTDataset(
            [
                write(
                    tmp_path / "sft_bad.parquet",
                    {
                        "prompt": ["q"],
                        "response": [[{"role": "user", "content": "not an answer"}]],
                    },
                )
            ],
            tokenizer,
            prompt_key="prompt",
            response_key="response",
            max_prompt_length=64,
            max_response_length=64,
            overlong="filter",
        )


# ---------------------------------------------------------------- SFT


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
