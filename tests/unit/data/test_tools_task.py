"""The built-in tool task (spmdrl/data/tools_task.py): generated rows, held-out split, cached files."""

from __future__ import annotations

import collections
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spmdrl.data import tools_task
from spmdrl.data.tiny_task import TinyTaskConfig, resolve_data_files
from spmdrl.data.tools_task import ToolsTaskConfig
from spmdrl.rewards import tiny_tools
from spmdrl.tools import parse
from spmdrl.tools.arith import evaluate

SMALL = ToolsTaskConfig(num_train=600, num_test=60)


def operands(row: dict) -> tuple[int, int]:
    a, b = row["extra_info"]["expression"].split(" * ")
    return int(a), int(b)


# ------------------------------------------------------------------------------- generated rows


def test_same_config_same_rows_other_seed_other_rows():
    assert tools_task.generate(SMALL) == tools_task.generate(ToolsTaskConfig(num_train=600, num_test=60))
    train, test = tools_task.generate(SMALL)
    other_train, other_test = tools_task.generate(ToolsTaskConfig(num_train=600, num_test=60, seed=7))
    assert [operands(r) for r in train] != [operands(r) for r in other_train]
    assert [operands(r) for r in test] != [operands(r) for r in other_test]


def test_test_split_depends_only_on_its_own_settings():
    _, test = tools_task.generate(SMALL)
    _, again = tools_task.generate(
        ToolsTaskConfig(num_train=1500, num_test=60, tool_fraction=0.5, other_tool_fraction=0.0)
    )
    assert test == again


def test_splits_are_disjoint_and_without_duplicates():
    train, test = tools_task.generate(ToolsTaskConfig(num_train=3000, num_test=200))
    assert len(train) == 3000 and len(test) == 200
    train_pairs = [frozenset(operands(r)) for r in train]
    test_pairs = [frozenset(operands(r)) for r in test]
    assert len(set(train_pairs)) == len(train_pairs) and len(set(test_pairs)) == len(test_pairs)
    assert not set(train_pairs) & set(test_pairs), "a test problem (in either operand order) is in train"


def test_rows_follow_verls_schema_and_demonstrations_are_right():
    cfg = ToolsTaskConfig(num_train=600, num_test=60, min_digits=3, max_digits=5)
    train, test = tools_task.generate(cfg)
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            a, b = operands(row)
            assert 100 <= a <= 99999 and 100 <= b <= 99999
            assert row["data_source"] == tools_task.DATA_SOURCE == tiny_tools.DATA_SOURCE
            assert row["agent_name"] == "tool_agent"
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(a * b)}
            info = row["extra_info"]
            assert info["split"] == split and info["index"] == i and info["tools_kwargs"] is None
            (message,) = row["prompt"]
            assert message["role"] == "user"
            assert message["content"] == f"{info['question']} {tools_task.INSTRUCTION}"
            assert f"{a} * {b}" in info["question"]
            demo = row["response"]
            if len(demo) == 3:  # a tool demonstration: call, result, copied answer
                assert [m["role"] for m in demo] == ["assistant", "tool", "assistant"]
                parsed = parse(demo[0]["content"])
                assert not parsed.errors and len(parsed.calls) == 1
                call = parsed.calls[0]
                assert call.name == "calculator" and call.arguments == {"expression": f"{a} * {b}"}
                assert demo[1]["content"] == str(evaluate(call.arguments["expression"])) == str(a * b)
                assert demo[2]["content"] == f"#### {a * b}"
                assert tiny_tools.compute_score(demo[2]["content"], str(a * b)) == 1.0
            else:  # a direct guess, always wrong
                assert split == "train"
                (guess,) = demo
                assert guess["role"] == "assistant" and guess["content"].startswith("#### ")
                assert tiny_tools.compute_score(guess["content"], str(a * b)) == 0.0


def test_guess_is_close_but_never_the_product():
    assert tools_task.guess(930453) == 930000
    assert tools_task.guess(4143615) == 4100000
    assert tools_task.guess(120000) == 130000  # already round: one step up
    for p in (10000, 99999, 123456789, 5000000000):
        assert tools_task.guess(p) != p


def test_tool_use_in_demonstrations_depends_on_the_phrasing():
    cfg = ToolsTaskConfig(
        num_train=6000, num_test=10, tool_phrasings=2, tool_fraction=0.9, other_tool_fraction=0.1
    )
    train, _ = tools_task.generate(cfg)
    n = len(tools_task.PHRASINGS)
    calls, counts = collections.Counter(), collections.Counter()
    for i, row in enumerate(train):
        counts[i % n] += 1
        calls[i % n] += len(row["response"]) == 3
        assert row["extra_info"]["question"] == tools_task.PHRASINGS[i % n].format(
            e=row["extra_info"]["expression"]
        )
    for t in range(n):
        expected = 0.9 if t < 2 else 0.1
        assert abs(calls[t] / counts[t] - expected) < 0.05, (t, calls[t] / counts[t])
    all_tool, _ = tools_task.generate(
        ToolsTaskConfig(num_train=60, num_test=6, tool_fraction=1.0, other_tool_fraction=1.0)
    )
    assert all(len(r["response"]) == 3 for r in all_tool)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="min_digits"):
        tools_task.generate(ToolsTaskConfig(min_digits=4, max_digits=3))
    with pytest.raises(ValueError, match="tool_fraction"):
        tools_task.generate(ToolsTaskConfig(tool_fraction=1.5))
    with pytest.raises(ValueError, match="tool_phrasings"):
        tools_task.generate(ToolsTaskConfig(tool_phrasings=7))
    with pytest.raises(ValueError, match="too many"):
        tools_task.generate(ToolsTaskConfig(min_digits=1, max_digits=1, num_train=100))


def test_named_splits_resolve_to_cached_files(tmp_path: Path):
    train_path, test_path, other = resolve_data_files(
        ["tiny_tools:train", "tiny_tools:test", "mine.parquet"], tmp_path, TinyTaskConfig(), SMALL
    )
    assert other == Path("mine.parquet")
    assert train_path.parent == test_path.parent == tmp_path / f"tiny_tools-{tools_task.config_hash(SMALL)}"
    train, test = tools_task.generate(SMALL)
    assert pq.read_table(train_path).to_pylist() == train
    assert pq.read_table(test_path).to_pylist() == test
    # Cached: a second call finds the files; another config gets its own directory.
    mtime = train_path.stat().st_mtime_ns
    assert resolve_data_files(["tiny_tools:train"], tmp_path, TinyTaskConfig(), SMALL) == [train_path]
    assert train_path.stat().st_mtime_ns == mtime
    (other_train,) = resolve_data_files(
        ["tiny_tools:train"], tmp_path, TinyTaskConfig(), ToolsTaskConfig(num_train=10, num_test=5)
    )
    assert other_train.parent != train_path.parent
    with pytest.raises(ValueError, match="tiny_tools:train, tiny_tools:test"):
        resolve_data_files(["tiny_tools:valid"], tmp_path, TinyTaskConfig(), SMALL)


def test_cli_writes_both_splits(tmp_path: Path):
    tools_task.main(
        ["--out", str(tmp_path), "--num-train", "20", "--num-test", "6", "--tool-fraction", "1.0"]
    )
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 20
    assert pq.read_table(tmp_path / "test.parquet").num_rows == 6


def test_recipe_loads():
    from spmdrl.config_loader import load_config

    cfg = load_config(["recipe=grpo_tools_tiny"])
    assert cfg.data.train_files == ["tiny_tools:train"] and cfg.data.val_files == ["tiny_tools:test"]
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.tools == ["calculator"]
    assert cfg.warmstart.enabled
