"""spmdrl/preflight.py: the data files and model paths a config names, checked before a run starts, on
real files. The hub-id cases need a fresh interpreter each: tests/integration/test_preflight_hub.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdrl.config import Config, ConfigError
from spmdrl.data.parquet import DataError
from spmdrl.preflight import check_data_files, check_inputs, check_model


def _cfg(train_files: list[str], val_files: list[str] | None = None, **data: str) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, train_files=train_files, val_files=val_files or [], **data)
    )


def _parquet(path: Path, **columns: list) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_good_files_and_the_built_in_task_pass(tmp_path: Path) -> None:
    train = _parquet(tmp_path / "train.parquet", prompt=["1+1?"], reward_model=[{"ground_truth": "2"}])
    assert check_data_files(_cfg([str(train)], ["tiny:test"])) == [str(train), "tiny:test"]


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda d: d / "missing.parquet", r"missing.parquet does not exist; check data.train_files"),
        (lambda d: (d / "x.parquet").write_text("a,b\n") and d / "x.parquet", "is not a readable parquet"),
        (
            lambda d: _parquet(d / "q.parquet", question=["1+1?"]),
            r"has no column 'prompt' \(it has: question\)",
        ),
        (lambda d: _parquet(d / "e.parquet", prompt=pa.array([], pa.string())), "has no rows"),
    ],
    ids=["missing", "not_parquet", "no_prompt_column", "no_rows"],
)
def test_bad_data_files_name_the_file_and_the_fix(tmp_path: Path, make, expect: str) -> None:
    with pytest.raises(DataError, match=expect):
        check_data_files(_cfg([str(make(tmp_path))]))


def test_the_prompt_column_is_the_configured_one(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "q.parquet", question=["1+1?"])
    assert check_data_files(_cfg([str(path)], prompt_key="question")) == [str(path)]
    with pytest.raises(DataError, match="set data.prompt_key to the column"):
        check_data_files(_cfg([str(path)]))


def test_an_unknown_built_in_split_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data.val_files: 'tiny:tset'.*tiny:train, tiny:test"):
        check_data_files(_cfg(["tiny:train"], ["tiny:tset"]))


def test_local_model_directories(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ConfigError, match=r"model.path=.*no config.json"):
        check_model(str(model), "model.path")
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no \*.safetensors"):
        check_model(str(model), "model.path")
    (model / "model.safetensors").write_bytes(b"")
    assert "local directory" in check_model(str(model), "model.path")
    with pytest.raises(ConfigError, match=r"critic.model_path=.*does not look like a hub id"):
        check_model(str(tmp_path / "no" / "such"), "critic.model_path")
    assert check_model("tiny", "model.path") == "model.path=tiny (built in)"


def test_check_inputs_covers_the_critic(tmp_path: Path) -> None:
    cfg = Config()
    cfg = dataclasses.replace(cfg, critic=dataclasses.replace(cfg.critic, model_path=str(tmp_path / "x")))
    with pytest.raises(ConfigError, match="critic.model_path"):
        check_inputs(cfg)


def test_expert_parallelism_is_checked_against_the_model(tmp_path: Path) -> None:
    from spmdrl.preflight import check_expert_parallel

    assert check_expert_parallel("tiny-moe", 2, lora=False) == "parallel.ep=2 (2 of 4 experts per rank)"
    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide the 4 experts .* 1, 2, 4"):
        check_expert_parallel("tiny-moe", 3, lora=False)
    with pytest.raises(ConfigError, match="model.path=tiny is a dense model .* set parallel.ep=1"):
        check_expert_parallel("tiny", 2, lora=False)
    with pytest.raises(ConfigError, match=r"parallel.ep=2 with model.lora .* not supported"):
        check_expert_parallel("tiny-moe", 2, lora=True)
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 6})
    )
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide the 6 experts .* 1, 2, 3, 6"):
        check_expert_parallel(str(model), 4, lora=False)
    assert check_expert_parallel(str(model), 3, lora=False) == "parallel.ep=3 (2 of 6 experts per rank)"
    # transformers 5 saves the count as num_local_experts (the built-in tiny-moe's config.json too).
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 8}
    (model / "config.json").write_text(json.dumps(config))
    assert check_expert_parallel(str(model), 4, lora=False) == "parallel.ep=4 (2 of 8 experts per rank)"
