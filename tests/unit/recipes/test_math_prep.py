"""MATH preparation (recipes/math_prep.py) on tiny local copies the test writes (no network): verl's schema,
the \\boxed{} ground truth, both local layouts, the errors; the math rule scores each reference solution 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spmdrl.recipes import math_prep

# Problems and solutions written for this test, in MATH's style.
TRAIN = [
    {
        "problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
        "solution": "Adding, $\\frac{1}{4}+\\frac{1}{4} = \\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Prealgebra",
    },
    {
        "problem": "Solve $x^2 = 9$ for $x > 0$.",
        "solution": "Since $x = \\pm 3$ and $x > 0$, $x = \\boxed{3}$.",
        "level": "Level 2",
        "type": "Algebra",
    },
]
TEST = [
    {
        "problem": "Find the domain of $\\sqrt{3 - x}$.",
        "solution": "We need $3 - x \\ge 0$, so the domain is $\\boxed{(-\\infty, 3]}$.",
        "level": "Level 3",
        "type": "Algebra",
    }
]
TRUTHS = {"train": ["\\frac{1}{2}", "3"], "test": ["(-\\infty, 3]"]}


def write_jsonl(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def test_last_boxed() -> None:
    assert math_prep.last_boxed("a $\\boxed{\\frac{1}{2}}$ b") == "\\frac{1}{2}"
    assert math_prep.last_boxed("first \\boxed{1}, then \\boxed{2}") == "2"
    assert math_prep.last_boxed("\\fbox{7}") == "7"
    assert math_prep.last_boxed("so $\\boxed 5$.") == "5"
    assert math_prep.last_boxed("no answer") is None
    assert math_prep.last_boxed("\\boxed{never closed") is None


def test_jsonl_to_verl_schema(tmp_path: Path) -> None:
    paths = math_prep.prepare(tmp_path / "out", write_jsonl(tmp_path / "raw"))
    for split, rows in (("train", TRAIN), ("test", TEST)):
        table = pq.read_table(paths[split])
        assert table.schema.equals(math_prep.SCHEMA)
        got = table.to_pylist()
        assert [r["reward_model"]["ground_truth"] for r in got] == TRUTHS[split]
        for i, (row, src) in enumerate(zip(got, rows, strict=True)):
            assert row["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
            assert row["ability"] == "math"
            assert row["prompt"] == [{"role": "user", "content": f"{src['problem']} {math_prep.INSTRUCTION}"}]
            assert row["reward_model"]["style"] == "rule"
            assert row["extra_info"] == {
                "split": split,
                "index": i,
                "level": src["level"],
                "type": src["type"],
            }


def test_release_layout_and_the_reward_agree(tmp_path: Path) -> None:
    """The original release's folders (split/subject/n.json); each reference solution, scored with the
    math rule against its prepared ground truth, gets 1."""
    pytest.importorskip("math_verify", reason='math-verify is not installed: pip install -e ".[math]"')
    from spmdrl.rewards.math_answers import compute_score

    raw = tmp_path / "MATH"
    for split, rows in (("train", TRAIN), ("test", TEST)):
        for i, row in enumerate(rows):
            f = raw / split / row["type"].lower() / f"{i}.json"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(row))
    paths = math_prep.prepare(tmp_path / "out", raw)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        got = pq.read_table(paths[split]).to_pylist()
        assert sorted(r["reward_model"]["ground_truth"] for r in got) == sorted(TRUTHS[split])
        by_problem = {r["problem"]: r["solution"] for r in rows}
        for row in got:
            problem = row["prompt"][0]["content"].removesuffix(f" {math_prep.INSTRUCTION}")
            assert compute_score(by_problem[problem], row["reward_model"]["ground_truth"]) == 1.0


def test_cli_and_its_errors(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "spmdrl.recipes.math_prep", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = run("--from-local", str(write_jsonl(tmp_path / "raw")), "--out", str(tmp_path / "out"))
    assert ok.returncode == 0, ok.stderr
    assert "train: 2 rows" in ok.stdout and "test: 1 rows" in ok.stdout

    bad = tmp_path / "bad"
    write_jsonl(bad)
    (bad / "train.jsonl").write_text(json.dumps({"problem": "2+2?", "solution": "It is 4."}) + "\n")
    res = run("--from-local", str(bad), "--out", str(tmp_path / "out2"))
    assert res.returncode == 2
    assert "row 0" in res.stderr and "\\boxed" in res.stderr and "train.jsonl" in res.stderr
    assert not (tmp_path / "out2").exists(), "nothing is written when a row is bad"

    res = run("--from-local", str(tmp_path / "empty"), "--out", str(tmp_path / "out3"))
    assert res.returncode == 2 and "train.jsonl" in res.stderr
