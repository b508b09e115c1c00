"""Parquet reading (spmdrl/data/parquet.py): missing, empty and wrongly typed files name what is wrong."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdrl.data.parquet import DataError, read_table
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sft import SFTDataset
from tests.unit.data.chat_data import verl_rows, write


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
