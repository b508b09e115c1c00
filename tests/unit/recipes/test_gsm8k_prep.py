"""GSM8K preparation (recipes/gsm8k_prep.py) and the grpo_gsm8k recipe config, on a local sample (no network)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdrl.config import derive, derive_rl
from spmdrl.config_loader import load_config
from spmdrl.data.prompts import PromptDataset
from spmdrl.recipes import gsm8k_prep
from spmdrl.rewards.gsm8k import compute_score
from spmdrl.rewards.registry import load_reward_fn

# GSM8K-style problems written for this test: (question, reference solution, its final number).
TRAIN = [
    (
        "A farmer sells 40 crates of apples at $30 each. How many dollars does he make?",
        "Each crate sells for $30, so 40 crates make 40 * 30 = <<40*30=1200>>1200 dollars.\n#### 1,200",
        "1200",
    ),
    (
        "Sara reads 12 pages a day. How many pages does she read in a week?",
        "A week has 7 days, so she reads 12 * 7 = <<12*7=84>>84 pages.\n#### 84",
        "84",
    ),
    (
        "A rope 10 meters long is cut into 4 equal pieces. How long is each piece in meters?",
        "Each piece is 10 / 4 = <<10/4=2.5>>2.5 meters long.\n#### 2.5",
        "2.5",
    ),
]
TEST = [
    (
        "Tom had 9 marbles and lost 4. How many marbles does he have left?",
        "He has 9 - 4 = <<9-4=5>>5 marbles left.\n#### 5",
        "5",
    ),
]


def as_rows(problems: list[tuple[str, str, str]]) -> list[dict[str, str]]:
    return [{"question": q, "answer": a} for q, a, _ in problems]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spmdrl.recipes.gsm8k_prep", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def tokenizer():
    from spmdrl.models.tiny import build_tokenizer

    return build_tokenizer()


def test_convert_writes_verl_rows() -> None:
    rows = gsm8k_prep.convert(as_rows(TRAIN), "train")
    assert len(rows) == len(TRAIN)
    for i, (row, (question, answer, truth)) in enumerate(zip(rows, TRAIN, strict=True)):
        assert row["data_source"] == "openai/gsm8k"
        assert row["ability"] == "math"
        assert row["prompt"] == [
            {
                "role": "user",
                "content": question + ' Let\'s think step by step and output the final answer after "####".',
            }
        ]
        # "#### 1,200" must become "1200": the reward compares the extracted number as written.
        assert row["reward_model"] == {"style": "rule", "ground_truth": truth}
        assert row["extra_info"] == {"split": "train", "index": i, "answer": answer, "question": question}


def test_cli_from_jsonl_loads_as_prompt_dataset(tmp_path: Path, tokenizer) -> None:
    src, out = tmp_path / "gsm8k_jsonl", tmp_path / "out"
    src.mkdir()
    write_jsonl(src / "train.jsonl", as_rows(TRAIN))
    write_jsonl(src / "test.jsonl", as_rows(TEST))

    proc = run_cli("--from-jsonl", str(src), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # Atomic writes leave no temp files behind.
    assert sorted(p.name for p in out.iterdir()) == ["test.parquet", "train.parquet"]

    # The columns and nested types of verl's GSM8K files.
    schema = pq.read_schema(out / "train.parquet")
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("extra_info").type.field("index").type == pa.int64()
    assert {f.name for f in schema.field("extra_info").type} == {"split", "index", "answer", "question"}

    auto = load_reward_fn("auto")
    for split, problems in (("train", TRAIN), ("test", TEST)):
        ds = PromptDataset(
            [out / f"{split}.parquet"],
            tokenizer,
            prompt_key="prompt",
            max_prompt_length=512,
            overlong="error",
        )
        assert len(ds) == len(problems)
        for i, (question, answer, truth) in enumerate(problems):
            ex = ds[i]
            assert ex.ground_truth == truth
            assert ex.data_source == "openai/gsm8k"
            assert ex.extra_info["split"] == split and ex.extra_info["question"] == question
            assert ex.messages[0]["content"].startswith(question)
            assert tokenizer.decode(ex.prompt_ids).endswith("<|im_start|>assistant\n")
            # The reference solution scores 1, a wrong final number 0: with the GSM8K rule directly and
            # through reward.fn=auto, which picks the rule from the data_source column the script wrote.
            wrong = answer.rsplit("####", 1)[0] + "#### 7777"
            assert compute_score(answer, ex.ground_truth) == 1.0
            assert compute_score(wrong, ex.ground_truth) == 0.0
            kwargs = {"data_source": ex.data_source, "extra_info": ex.extra_info}
            assert auto(answer, ex.ground_truth, **kwargs) == 1.0
            assert auto(wrong, ex.ground_truth, **kwargs) == 0.0


def test_answer_without_final_number_is_an_error(tmp_path: Path) -> None:
    bad = [*as_rows(TRAIN), {"question": "How many legs do 3 cats have?", "answer": "3 * 4 = 12 legs."}]
    with pytest.raises(
        gsm8k_prep.GSM8KFormatError, match=r"train split\) row 3: the answer has no final '####"
    ):
        gsm8k_prep.convert(bad, "train")
    with pytest.raises(gsm8k_prep.GSM8KFormatError, match="field 'answer' must be a string"):
        gsm8k_prep.convert([{"question": "q", "solution": "#### 1"}], "test")

    # The CLI names the file and row, exits non-zero, and writes nothing: both splits are checked first.
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    write_jsonl(src / "train.jsonl", as_rows(TRAIN))
    write_jsonl(src / "test.jsonl", bad)
    proc = run_cli("--from-jsonl", str(src), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{src / 'test.jsonl'} (test split) row 3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_missing_jsonl_and_missing_datasets_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(gsm8k_prep.GSM8KFormatError, match="train.jsonl does not exist"):
        gsm8k_prep.prepare(tmp_path / "out", from_jsonl=tmp_path)
    # Without the optional `datasets` library the hub path says what to install (None in sys.modules
    # makes the import fail, whether or not it is installed here).
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(gsm8k_prep.MissingDependencyError, match=r"pip install 'spmdrl\[data\]'"):
        gsm8k_prep.prepare(tmp_path / "out")


def test_an_unreachable_hub_fails_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("datasets")
    from huggingface_hub import constants

    from spmdrl.data.parquet import DataError
    from spmdrl.testing.spawn import free_port

    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    start = time.monotonic()
    with pytest.raises(DataError, match=r"hub dataset openai/gsm8k \(config main\) .* is unreachable") as e:
        gsm8k_prep.prepare(tmp_path / "out")
    assert time.monotonic() - start < 5  # not datasets' ~25 s of retries
    assert not (tmp_path / "out").exists()
    assert "convert a local copy instead (--from-jsonl DIR)" in str(e.value)


def test_recipe_config_loads_and_reads_the_prepared_files() -> None:
    cfg = load_config(["recipe=grpo_gsm8k"])
    assert (cfg.name, cfg.entry) == ("grpo_gsm8k", "grpo")
    # The recipe reads where the script writes by default.
    out = Path(gsm8k_prep.DEFAULT_OUT)
    assert [Path(f) for f in cfg.data.train_files] == [out / "train.parquet"]
    assert [Path(f) for f in cfg.data.val_files] == [out / "test.parquet"]
    assert cfg.reward.fn == "auto"
    assert load_config(["recipe=grpo_gsm8k", "model.path=some/model"]).model.path == "some/model"
    # A missing file's error names the command that writes them where the recipes read (ppo_gsm8k too).
    command = f"python -m spmdrl.recipes.gsm8k_prep --out {gsm8k_prep.DEFAULT_OUT}"
    assert cfg.data.prepare == load_config(["recipe=ppo_gsm8k"]).data.prepare == command


def test_recipe_config_batch_arithmetic_on_8_gpus() -> None:
    cfg = load_config(["recipe=grpo_gsm8k"])
    derived = derive(cfg, world_size=8, num_train_samples=7473, samples_per_item=cfg.rollout.n)
    rl = derive_rl(cfg, derived)
    # The schedule of verl's example: 7473 // 1024 = 7 steps per epoch, 15 epochs, and 1024 / 256 = 4
    # optimizer steps per training step.
    assert (derived.steps_per_epoch, derived.total_steps) == (7, 105)
    assert rl.mini_batches_per_step == 4
    assert rl.max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length
