"""The RL prompt dataset (spmdrl/data/prompts.py): verl's schema, several files, filtering, errors that
name the file, row and column."""

from __future__ import annotations

import pytest

from spmdrl.data.parquet import DataError, read_table
from spmdrl.data.prompts import PromptDataset
from tests.unit.data.chat_data import chatml, verl_rows, write


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
