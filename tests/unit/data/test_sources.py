"""Data entries of every kind (spmdrl/data/sources.py) on real files: jsonl and json files, a ``datasets``
save_to_disk directory and a directory of data files, with split and column mapping; each goes through the
checks parquet does, with the same errors. A hub id that cannot be had says so at once; a recipe whose
data a prep script makes names the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdrl.config_loader import load_config
from spmdrl.data.config import ColumnMap, DataConfig
from spmdrl.data.parquet import DataError
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sft import SFTDataset
from spmdrl.data.sources import ReadOptions, check_sources, read_options, read_sources
from spmdrl.errors import ConfigError
from spmdrl.testing.prefork import run_train
from spmdrl.testing.spawn import free_port

# GSM8K's shape (question, answer) as a user has it, before verl's preprocessing.
ROWS = [
    {"question": "what is 1 + 1?", "answer": "2", "data_source": "tiny/add"},
    {"question": "what is 2 + 3?", "answer": "5", "data_source": "tiny/add"},
    {"question": "what is 4 + 4?", "answer": "8", "data_source": "tiny/add"},
]
MAPPED = ReadOptions(columns={"prompt": "question", "ground_truth": "answer"})
# What the RL loader reads, and how it names the keys in errors (spmdrl.data.prompts.PromptDataset).
RL = {"columns": ["prompt", "reward_model"], "optional_columns": ["data_source", "extra_info"]}
PROMPT_KEYS = {"prompt": "data.prompt_key"}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _json(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture
def datasets_lib(tmp_path, monkeypatch):
    """The datasets library with its cache (what load_dataset writes for a folder) under tmp_path."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return datasets


def _saved(datasets, path: Path) -> Path:
    """A DatasetDict saved with save_to_disk: train holds ROWS, test the last row."""
    train = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict(train=train, test=train.select([2])).save_to_disk(str(path))
    return path


def _folder(path: Path) -> Path:
    """A directory of data files in datasets' layout: train.jsonl and test.jsonl."""
    path.mkdir()
    _jsonl(path / "train.jsonl", ROWS)
    _jsonl(path / "test.jsonl", ROWS[2:])
    return path


def _expected(rows: list[dict]) -> list[dict]:
    return [
        {
            "prompt": r["question"],
            "reward_model": {"ground_truth": r["answer"]},
            "data_source": r["data_source"],
        }
        for r in rows
    ]


@pytest.mark.parametrize("write", [_jsonl, _json], ids=["jsonl", "json"])
def test_json_files_read_with_the_column_mapping(tmp_path, write) -> None:
    path = write(tmp_path / f"rows.{write.__name__[1:]}", ROWS)
    source = read_sources([path], **RL, options=MAPPED)
    assert source.table.to_pylist() == _expected(ROWS)
    assert source.where(2) == f"{path} row 2"


def test_a_mapped_column_shadows_the_source_column_of_that_name(tmp_path) -> None:
    rows = [{**r, "prompt": "not this one", "reward_model": {"ground_truth": "nor this"}} for r in ROWS]
    path = _parquet_rows(tmp_path / "both.parquet", rows)
    source = read_sources([path], **RL, options=MAPPED)
    assert source.table.to_pylist() == _expected(ROWS)
    (view,) = check_sources([path], ["prompt"], options=MAPPED)
    assert view.columns == ["prompt", "reward_model", "data_source"]


@pytest.mark.parametrize("kind", ["disk", "folder"])
def test_dataset_directories_take_the_split_and_the_mapping(tmp_path, datasets_lib, kind) -> None:
    path = _saved(datasets_lib, tmp_path / "saved") if kind == "disk" else _folder(tmp_path / "folder")
    train = read_sources([path], **RL, options=MAPPED)
    assert train.table.to_pylist() == _expected(ROWS)
    assert train.where(1) == f"dataset directory {path} (split train) row 1"
    # The split from the options (data.val_split), and from the entry itself.
    val_opts = ReadOptions(split="test", columns=MAPPED.columns)
    assert read_sources([path], **RL, options=val_opts).table.to_pylist() == _expected(ROWS[2:])
    assert read_sources([f"{path}:test"], **RL, options=MAPPED).table.to_pylist() == _expected(ROWS[2:])
    with pytest.raises(DataError, match=r"no split 'validation'; it has train, test"):
        read_sources([f"{path}:validation"], **RL, options=MAPPED)


def _parquet(path: Path) -> Path:
    return _parquet_rows(path, ROWS)


def _parquet_rows(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "json", "disk", "folder"])
def test_a_missing_prompt_column_is_the_same_error_for_every_kind(tmp_path, datasets_lib, kind) -> None:
    make = {
        "parquet": lambda: _parquet(tmp_path / "rows.parquet"),
        "jsonl": lambda: _jsonl(tmp_path / "rows.jsonl", ROWS),
        "json": lambda: _json(tmp_path / "rows.json", ROWS),
        "disk": lambda: _saved(datasets_lib, tmp_path / "saved"),
        "folder": lambda: _folder(tmp_path / "folder"),
    }
    path = make[kind]()
    named = (
        f"data file {path}"
        if kind in ("parquet", "jsonl", "json")
        else f"dataset directory {path} (split train)"
    )
    expect = (
        f"{named} has no column 'prompt' (it has: question, answer, data_source); "
        "set data.prompt_key to the column that holds it"
    )
    with pytest.raises(DataError) as e:
        read_sources([path], **RL, column_keys=PROMPT_KEYS)
    assert str(e.value) == expect
    with pytest.raises(DataError) as e:  # --check's view says the same
        check_sources([path], ["prompt"], PROMPT_KEYS)
    assert str(e.value) == expect
    # A mapping to a column the source lacks names data.columns.
    with pytest.raises(
        DataError,
        match=r"has no column 'query' \(it has: question, answer, data_source\); "
        r"set data.columns.prompt",
    ):
        read_sources([path], **RL, options=ReadOptions(columns={"prompt": "query"}))


def test_the_loaders_read_a_mapped_jsonl_file(tmp_path, tokenizer) -> None:
    rows = [{**r, "solution": f"the answer is {r['answer']}"} for r in ROWS]
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    prompts = PromptDataset(
        [path], tokenizer, prompt_key="prompt", max_prompt_length=64, overlong="error", options=MAPPED
    )
    assert [prompts[i].ground_truth for i in range(3)] == ["2", "5", "8"]
    assert prompts[0].messages == [{"role": "user", "content": "what is 1 + 1?"}]
    assert prompts[1].data_source == "tiny/add"
    sft = SFTDataset(
        [path],
        tokenizer,
        prompt_key="prompt",
        response_key="response",
        max_prompt_length=64,
        max_response_length=64,
        overlong="error",
        options=ReadOptions(columns={"prompt": "question", "response": "solution"}),
    )
    assert len(sft) == 3 and sum(sft[0].loss_mask) > 0


def test_bad_json_lines_and_mixed_types_name_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2 is not valid JSON"):
        read_sources([bad], ["prompt"])
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": 3}])
    with pytest.raises(DataError, match=r"mixed.jsonl: its rows do not share column types"):
        read_sources([mixed], ["prompt"])


def test_a_missing_file_names_the_prepare_command(tmp_path) -> None:
    data = DataConfig(
        train_files=[str(tmp_path / "gsm8k" / "train.parquet")], prepare="python prep.py --out X"
    )
    with pytest.raises(DataError) as e:
        check_sources(data.train_files, ["prompt"], options=read_options(data, "data.train_files"))
    assert str(e.value) == (
        f"data file {tmp_path}/gsm8k/train.parquet does not exist; make it with: python prep.py --out X  "
        "(or fix data.train_files)"
    )
    # Neither a path nor a hub id.
    with pytest.raises(DataError, match=r"data.val_files: '\./nowhere' is no local file or directory"):
        check_sources(["./nowhere"], ["prompt"], options=read_options(data, "data.val_files"))


def test_data_columns_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match="data.columns.prompt and data.prompt_key=question both name"):
        DataConfig(columns=ColumnMap(prompt="q"), prompt_key="question").check()
    with pytest.raises(ConfigError, match="data.columns.ground_truth and data.columns.reward_model"):
        DataConfig(columns=ColumnMap(ground_truth="a", reward_model="b")).check()
    # From the command line, both spellings; a column spmdrl does not read is an unknown key.
    for override in ["data.columns={prompt: question, ground_truth: answer}", "data.columns.prompt=question"]:
        cfg = load_config(["recipe=grpo_tiny", override])
        assert read_options(cfg.data, "data.train_files").columns["prompt"] == "question"
    with pytest.raises(ConfigError, match=r"unknown config key 'data.columns.question'"):
        load_config(["recipe=grpo_tiny", "data.columns.question=prompt"])


def test_without_datasets_the_error_names_the_extra(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(
        sys.modules, "datasets", None
    )  # what `import datasets` meets when it is not installed
    with pytest.raises(DataError, match=r"needs the `datasets` library: pip install 'spmdrl\[data\]'"):
        check_sources([_folder(tmp_path / "folder")], ["prompt"])


def test_an_unreachable_hub_fails_at_once(monkeypatch) -> None:
    pytest.importorskip("datasets")
    from huggingface_hub import constants

    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        check_sources(["my-org/my-data:main:train"], ["prompt"])
    assert time.monotonic() - start < 5  # not datasets' ~25 s of retries
    message = str(e.value)
    assert message.startswith("hub dataset my-org/my-data (config main, split train)")
    assert "is unreachable (ConnectionRefusedError" in message
    assert "datasets.load_dataset('my-org/my-data', 'main').save_to_disk('DIR')" in message


def test_an_offline_hub_says_so(tmp_path) -> None:
    pytest.importorskip("datasets")
    # A fresh interpreter: huggingface_hub and datasets read HF_HUB_OFFLINE at import.
    script = (
        "from spmdrl.data.sources import check_sources\n"
        "try:\n    check_sources(['my-org/my-data'], ['prompt'])\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env = {**clean, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("DataError hub dataset my-org/my-data (split train)"), res.stdout
    assert "not in the datasets cache and the hub is set offline (HF_HUB_OFFLINE)" in res.stdout
    assert "give DIR instead (no local file or directory is named my-org/my-data)" in res.stdout


def test_check_accepts_a_jsonl_train_file_and_names_the_prepare_command(tmp_path) -> None:
    from spmdrl.data import tiny_task
    from spmdrl.data.tiny_task import TinyTaskConfig, write_splits

    train = pq.read_table(write_splits(tmp_path / "cache", TinyTaskConfig())["train"]).to_pylist()
    path = _jsonl(tmp_path / "train.jsonl", train)
    res = run_train(["--check", "recipe=grpo_tiny", f"data.train_files=[{path}]"])
    assert res.returncode == 0, res.stderr
    assert f"data ({path}, tiny:test)" in res.stdout
    # The RL start's reward checks read through the mapping too: plain answers as reward_model.
    rows = [{**r, "data_source": tiny_task.DATA_SOURCE} for r in ROWS]
    mapped = _jsonl(tmp_path / "qa.jsonl", rows)
    args = [
        "--check",
        "recipe=grpo_tiny",
        f"data.train_files=[{mapped}]",
        "data.val_files=[]",
        "warmstart.enabled=false",
    ]
    res = run_train([*args, "data.columns={prompt: question, ground_truth: answer}"])
    assert res.returncode == 0, res.stderr
    assert f"on data_source '{tiny_task.DATA_SOURCE}'" in res.stdout
    res = run_train([*args, "data.columns.prompt=question"])
    assert res.returncode == 2
    assert "has no column 'reward_model'" in res.stderr and "data.columns.ground_truth" in res.stderr
    # The GSM8K recipe's files are not there: the error says how to make them.
    res = run_train(["--check", "recipe=grpo_gsm8k", f"data.train_files=[{tmp_path}/gsm8k/train.parquet]"])
    assert res.returncode == 2
    assert "make it with: python -m spmdrl.recipes.gsm8k_prep --out ~/data/gsm8k" in res.stderr
