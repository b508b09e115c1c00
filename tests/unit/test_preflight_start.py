"""``--check`` catches what an RL recipe's start would (spmdrl/preflight_start.py): each case below passed
``--check`` before and then failed at the start of the run, after torchrun, the process group and the
tokenizer; each now fails at ``--check`` with exit 2 and a message naming the problem, the same message
the start gives (the start runs the same checks: spmdrl.preflight.check_inputs on every rank).

Each case runs ``parse_config([..., "--check"])`` in this process (what ``python -m spmdrl.train --check``
runs, without the ~9 s of a fresh interpreter) on real files in tmp_path: parquet written with pyarrow, a
vLLM package's metadata (a ``.dist-info`` directory on sys.path, what importlib.metadata reads), a hub
answered by a local HTTP server speaking the hub's API.

Not tested here, and why:
- the real hub (no network here): a local server answers as the hub does for a missing repository (404
  with ``X-Error-Code: RepoNotFound``) and for a failure (500), through huggingface_hub's own client;
  ``huggingface_hub.constants.ENDPOINT`` is pointed at it, as HF_ENDPOINT would at import. The offline
  and unreachable hub cases run in fresh interpreters in tests/integration/test_preflight_hub.py;
- a math data source without math-verify: math-verify is installed here
  (spmdrl.rewards.math_answers.check_available has its own tests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from spmdrl.testing.fake_hub import HubHandler, fake_hub
from spmdrl.train import parse_config

_PROMPT = [{"role": "user", "content": "1+1?"}]
_TRUTH = {"ground_truth": "2", "style": "rule"}
_SOURCE = "spmdrl/tiny_arith"  # the built-in task's data source: reward.fn=auto scores it


def _parquet(path: Path, rows: int = 64, **columns: list) -> str:
    table = {"prompt": [_PROMPT] * rows, **{k: (v * rows if len(v) == 1 else v) for k, v in columns.items()}}
    pq.write_table(pa.table(table), path)
    return str(path)


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_tiny", "data.val_files=[]", *args, "--check"])
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def _data(path: str) -> list[str]:
    """``path`` as the training data; grpo_tiny's warm-start (SFT on a response column) off."""
    return [f"data.train_files=[{path}]", "warmstart.enabled=false"]


def _fake_vllm(d: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """An installed vLLM older than any supported one: its package metadata, first on sys.path."""
    info = d / "site" / "vllm-0.20.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.0\n")
    monkeypatch.syspath_prepend(str(d / "site"))
    return []


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[type[HubHandler]]:
    from huggingface_hub import constants

    with fake_hub() as (url, handler):
        for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        yield handler


def _model_dir(d: Path, **config: object) -> list[str]:
    """A local model directory of a supported family (its config.json; the weights are not read)."""
    model = d / "model"
    model.mkdir()
    fields = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_attention_heads": 4}
    (model / "config.json").write_text(json.dumps({**fields, "num_key_value_heads": 2, **config}))
    (model / "model.safetensors").write_bytes(b"")
    return [f"model.path={model}", "warmstart.enabled=false"]


# (case, the arguments it makes in tmp_path, what the error says): before, each said "config ok".
CASES: list[tuple[str, Callable[[Path, pytest.MonkeyPatch], list[str]], str]] = [
    (
        "data_source_without_a_builtin_reward",
        lambda d, _: _data(_parquet(d / "t.parquet", data_source=["my_src"], reward_model=[_TRUTH])),
        r"data.train_files\[0\]=.*t.parquet: reward.fn=auto has no built-in reward for data_source 'my_src'",
    ),
    (
        "no_data_source_column_under_auto",
        lambda d, _: _data(_parquet(d / "t.parquet", reward_model=[_TRUTH])),
        r"t.parquet \(it has no data_source column\): reward.fn=auto has no built-in reward for data_source ''",
    ),
    (
        "no_reward_model_column",
        lambda d, _: _data(_parquet(d / "t.parquet", data_source=[_SOURCE])),
        r"t.parquet has no column 'reward_model' \(it has: prompt, data_source\)",
    ),
    (
        "reward_model_without_ground_truth",
        lambda d, _: _data(
            _parquet(d / "t.parquet", data_source=[_SOURCE], reward_model=[{"style": "rule"}])
        ),
        r"t.parquet row 0: column reward_model must be a struct with a 'ground_truth' field",
    ),
    (
        "one_row_with_a_null_ground_truth",
        lambda d, _: _data(
            _parquet(
                d / "t.parquet",
                data_source=[_SOURCE],
                reward_model=[_TRUTH] * 5 + [{"ground_truth": None, "style": "rule"}] + [_TRUTH] * 58,
            )
        ),
        r"t.parquet row 5: column reward_model must be a struct with a 'ground_truth' field",
    ),
    (
        "fewer_prompts_than_a_batch_with_world_size",
        lambda d, _: [
            *_data(_parquet(d / "t.parquet", rows=4, data_source=[_SOURCE], reward_model=[_TRUTH])),
            "--world-size",
            "2",
        ],
        r"on 2 ranks \(--world-size\): the training set has 4 samples, fewer than one global batch",
    ),
    (
        "batch_that_does_not_split_over_the_launch_world_size",
        lambda d, mp: mp.setenv("WORLD_SIZE", "3") or [],  # torchrun's, or a launch script's
        r"on 3 ranks \(WORLD_SIZE\): trainer.global_batch_size=32 is not divisible by the data-parallel size 3",
    ),
    (
        "warm_start_data_without_a_response_column",
        lambda d, _: [
            f"data.train_files=[{_parquet(d / 't.parquet', data_source=[_SOURCE], reward_model=[_TRUTH])}]"
        ],  # grpo_tiny's warm-start is on
        r"t.parquet has no column 'response' .*\(the warm-start, warmstart.enabled=true, trains on it",
    ),
    (
        "sequences_longer_than_the_models_positions",
        lambda d, _: _model_dir(d, max_position_embeddings=64),
        r"max_response_length \(or rollout.max_model_len\) = \d+ exceeds the model's max_position_embeddings=64",
    ),
    (
        "rollout_tp_that_does_not_split_the_heads",
        lambda d, _: [*_model_dir(d), "rollout.tp=3"],
        r"rollout.tp=3 does not split the model's 4 attention heads \(2 key/value heads",
    ),
    (
        "unsupported_vllm_release",
        _fake_vllm,
        r"rollout.engine=vllm: found vllm 0.20.0, but spmdrl supports vllm>=0.24,<0.33",
    ),
]


@pytest.mark.parametrize(("make", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_what_the_start_would_refuse_fails_at_check(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path, pytest.MonkeyPatch], list[str]],
    expect: str,
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, err = _check(capsys, *make(tmp_path, monkeypatch))
    assert code == 2, out
    assert "config ok" not in out
    assert len(err.splitlines()) == 1, err
    assert re.search(expect, err), err


def test_a_misspelled_hub_model_id_fails_at_check(
    hub: type[HubHandler], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, err = _check(capsys, "model.path=Qwen/Qwen2.5-0.5B-Instrukt")
    assert code == 2, out
    assert "model.path=Qwen/Qwen2.5-0.5B-Instrukt: the hub (http://127.0.0.1:" in err
    assert "has no model repository 'Qwen/Qwen2.5-0.5B-Instrukt'" in err and "check the id" in err


def test_a_hub_that_does_not_answer_is_said_on_the_ok_line(
    hub: type[HubHandler], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    hub.status = 500
    code, out, err = _check(capsys, "model.path=my-org/my-model")
    assert code == 0, err
    assert "model.path=my-org/my-model (a hub id, not cached; not checked on the hub: " in out


def test_a_good_file_passes_and_the_ok_line_says_what_was_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _parquet(tmp_path / "t.parquet", data_source=[_SOURCE], reward_model=[_TRUTH])
    code, out, err = _check(capsys, *_data(path))
    assert code == 0, err
    assert f"reward.fn=auto on data_source '{_SOURCE}'" in out
    assert "plan not checked: the world size is unknown (add --world-size N)" in out
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, out, err = _check(capsys, *_data(path))
    assert code == 0, err
    assert "plan on 2 ranks (WORLD_SIZE): 40 steps" in out  # grpo_tiny: trainer.total_steps=40


def test_cfg_job_prints_the_config_before_its_inputs_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/data/gsm8k/*.parquet: not made yet
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_gsm8k", "model.path=./not-downloaded-yet", "--cfg", "job"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["data"]["train_files"] == ["~/data/gsm8k/train.parquet"]
    comments = [line for line in out.splitlines() if line.startswith("# missing: ")]
    make = (
        "(make it with: python -m spmdrl.recipes.gsm8k_prep --out ~/data/gsm8k)"  # the recipe's data.prepare
    )
    assert comments[:2] == [
        f"# missing: data.train_files[0] ~/data/gsm8k/train.parquet {make}",
        f"# missing: data.val_files[0] ~/data/gsm8k/test.parquet {make}",
    ]
    assert comments[2].startswith("# missing: model.path=./not-downloaded-yet: no such directory")
    assert out.rstrip().splitlines()[-1] == comments[-1]  # at the end, after the config
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_gsm8k", "model.path=./not-downloaded-yet", "--check"])
    assert exit_info.value.code == 2
    assert (
        "data file ~/data/gsm8k/train.parquet does not exist; "
        "make it with: python -m spmdrl.recipes.gsm8k_prep --out ~/data/gsm8k"
    ) in capsys.readouterr().err


def test_sft_data_without_a_response_column_fails_at_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _parquet(tmp_path / "t.parquet", data_source=[_SOURCE], reward_model=[_TRUTH])
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=sft_tiny", f"data.train_files=[{path}]", "data.val_files=[]", "--check"])
    assert exit_info.value.code == 2
    assert "t.parquet has no column 'response' (it has: prompt, data_source, reward_model)" in (
        capsys.readouterr().err
    )


def test_cfg_job_still_refuses_a_bad_file_that_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_tiny", f"data.train_files=[{bad}]", "--cfg", "job"])
    assert exit_info.value.code == 2
    assert "is not a readable parquet file" in capsys.readouterr().err
