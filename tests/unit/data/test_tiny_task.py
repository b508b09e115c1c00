"""The built-in arithmetic task: determinism, held-out test problems, demonstration format, parquet files."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdrl.data import tiny_task
from spmdrl.data.tiny_task import (
    TinyTaskConfig,
    generate,
    resolve_data_files,
    write_split_files,
    write_splits,
)

# The demonstration format the task promises: the equation, a newline, then "#### <answer>".
DEMO = re.compile(r"(\d+) ([+-]) (\d+) = (\d+)\n#### (\d+)")

SMALL = TinyTaskConfig(num_train=300, num_test=50)


def parse(row: dict) -> tuple[str, int, int, int]:
    """(op, a, b, claimed answer) of a row's demonstration; fails the test if it does not parse."""
    m = DEMO.fullmatch(row["response"])
    assert m, f"demonstration does not parse: {row['response']!r}"
    a, op, b, eq_result, answer = m.groups()
    assert eq_result == answer, f"equation and #### line disagree: {row['response']!r}"
    return op, int(a), int(b), int(answer)


def true_answer(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b


def test_same_seed_same_rows_and_other_seed_other_rows():
    assert generate(SMALL) == generate(TinyTaskConfig(num_train=300, num_test=50))
    other_train, other_test = generate(TinyTaskConfig(num_train=300, num_test=50, seed=SMALL.seed + 1))
    train, test = generate(SMALL)
    assert [r["response"] for r in train] != [r["response"] for r in other_train]
    assert [r["response"] for r in test] != [r["response"] for r in other_test]


def test_test_split_does_not_depend_on_num_train():
    _, test = generate(SMALL)
    _, test_more_train = generate(TinyTaskConfig(num_train=900, num_test=50))
    assert test == test_more_train


def test_train_and_test_share_no_question_and_no_problem():
    train, test = generate(TinyTaskConfig())
    assert len(train) == 2000 and len(test) == 200
    train_questions = {r["extra_info"]["question"] for r in train}
    test_questions = {r["extra_info"]["question"] for r in test}
    assert len(train_questions) == len(train) and len(test_questions) == len(test), "duplicate questions"
    assert not train_questions & test_questions
    train_problems = {parse(r)[:3] for r in train}
    test_problems = {parse(r)[:3] for r in test}
    assert not train_problems & test_problems


def test_every_row_is_a_consistent_verl_row():
    cfg = TinyTaskConfig(num_train=400, num_test=100, max_operand=15)
    train, test = generate(cfg)
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            op, a, b, claimed = parse(row)
            assert 0 <= a <= cfg.max_operand and 0 <= b <= cfg.max_operand
            truth = true_answer(op, a, b)
            assert truth >= 0
            assert claimed == truth  # correct_fraction defaults to 1
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(truth)}
            assert row["data_source"] == tiny_task.DATA_SOURCE
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            question = row["extra_info"]["question"]
            assert re.findall(r"\d+", question) == [str(a), str(b)]
            [message] = row["prompt"]
            assert message["role"] == "user"
            assert message["content"].startswith(question) and "####" in message["content"]


def test_correct_fraction_on_train_and_test_always_right():
    train, test = generate(TinyTaskConfig(num_train=2000, num_test=200, correct_fraction=0.3))
    correct = 0
    for row in train:
        op, a, b, claimed = parse(row)
        truth = true_answer(op, a, b)
        assert row["reward_model"]["ground_truth"] == str(truth), "ground truth must stay the true answer"
        if claimed == truth:
            correct += 1
        else:
            assert claimed >= 0 and 1 <= abs(claimed - truth) <= 3, f"implausible wrong answer: {row}"
    assert 0.25 * len(train) <= correct <= 0.35 * len(train)
    assert all(parse(r)[3] == true_answer(*parse(r)[:3]) for r in test)


def test_too_few_possible_questions_is_a_clear_error():
    with pytest.raises(ValueError, match="max_operand"):
        generate(TinyTaskConfig(num_train=5000, num_test=2, max_operand=2))
    with pytest.raises(ValueError, match="correct_fraction"):
        generate(TinyTaskConfig(correct_fraction=1.5))


def test_parquet_round_trip_keeps_verl_schema(tmp_path: Path):
    paths = write_splits(tmp_path, SMALL)
    train_rows, test_rows = generate(SMALL)
    for split, rows in (("train", train_rows), ("test", test_rows)):
        table = pq.read_table(paths[split])
        prompt_type = table.schema.field("prompt").type
        assert pa.types.is_list(prompt_type)
        assert {f.name: f.type for f in prompt_type.value_type} == {
            "role": pa.string(),
            "content": pa.string(),
        }
        assert table.schema.field("reward_model").type.field("ground_truth").type == pa.string()
        assert table.schema.field("response").type == pa.string()
        assert table.to_pylist() == rows


def test_write_splits_is_cached_per_config(tmp_path: Path):
    first = write_splits(tmp_path, SMALL)
    mtimes = {split: p.stat().st_mtime_ns for split, p in first.items()}
    again = write_splits(tmp_path, TinyTaskConfig(num_train=300, num_test=50))
    assert again == first
    assert {split: p.stat().st_mtime_ns for split, p in again.items()} == mtimes
    other = write_splits(tmp_path, TinyTaskConfig(num_train=300, num_test=50, seed=9))
    assert other["train"].parent != first["train"].parent
    assert first["train"].parent.parent == tmp_path


def test_concurrent_writers_leave_whole_files(tmp_path: Path):
    # Several writers replacing the same files at once (as ranks do) never leave a torn or temp file.
    threads = [threading.Thread(target=write_split_files, args=(tmp_path, SMALL)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]
    assert pq.read_table(tmp_path / "train.parquet").num_rows == SMALL.num_train


def test_resolve_data_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    train, test, user = resolve_data_files(["tiny:train", "tiny:test", "~/mine.parquet"], tmp_path, SMALL)
    assert pq.read_table(train).num_rows == SMALL.num_train
    assert pq.read_table(test).num_rows == SMALL.num_test
    assert user == tmp_path / "home" / "mine.parquet"
    with pytest.raises(ValueError, match=r"tiny:valid.*tiny:train"):
        resolve_data_files(["tiny:valid"], tmp_path, SMALL)


def test_cli_writes_both_splits(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    tiny_task.main(["--out", str(tmp_path / "out"), "--num-train", "20", "--num-test", "5", "--seed", "3"])
    assert pq.read_table(tmp_path / "out" / "train.parquet").num_rows == 20
    assert pq.read_table(tmp_path / "out" / "test.parquet").num_rows == 5
    assert "train.parquet" in capsys.readouterr().out


def test_systematic_wrong_offset_is_the_only_error() -> None:
    from collections import Counter

    cfg = TinyTaskConfig(num_train=1000, num_test=50, max_operand=9, correct_fraction=0.3, wrong_offset=1)
    train, _ = generate(cfg)
    offsets = Counter(
        int(r["response"].split("#### ")[1]) - int(r["reward_model"]["ground_truth"]) for r in train
    )
    assert set(offsets) == {0, 1}
    assert offsets[1] == round(0.7 * 1000)


def test_held_out_questions_share_problems_not_questions() -> None:
    cfg = TinyTaskConfig(num_train=1500, num_test=100, max_operand=9, held_out="questions")
    train, test = generate(cfg)
    q_train = {r["extra_info"]["question"] for r in train}
    q_test = {r["extra_info"]["question"] for r in test}
    assert not q_train & q_test
    problems = lambda rows: {r["response"].split("\n")[0] for r in rows}  # noqa: E731
    assert problems(train) & problems(test), "with held_out=questions the arithmetic facts overlap"
    with pytest.raises(ValueError, match="held_out"):
        generate(TinyTaskConfig(held_out="nope"))
