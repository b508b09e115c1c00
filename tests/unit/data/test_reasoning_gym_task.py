"""reasoning-gym tasks as a data source: the rows, disjoint splits, the cache, the config and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spmdrl.config_loader import load_config
from spmdrl.data import reasoning_gym_task as rgt
from spmdrl.data.reasoning_gym_task import ReasoningGymConfig, generate, split_seed, write_splits
from spmdrl.data.tiny_task import TinyTaskConfig, resolve_data_files
from spmdrl.errors import ConfigError
from spmdrl.rewards.reasoning_gym_score import decode_entry
from spmdrl.testing.prefork import run_train

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason='reasoning-gym is not installed: pip install -e ".[envs]"'
)

# lcm of two numbers in 1..6: 36 questions at most, so two seeded streams of 30 draws collide (below).
NARROW = {"lcm": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 6}}


def questions(rows: list[dict]) -> list[str]:
    return [r["prompt"][-1]["content"] for r in rows]


def test_rows_are_in_verls_schema_with_the_answer_format_and_the_entry() -> None:
    cfg = ReasoningGymConfig(train_size=12, test_size=5, system_prompt="direct")
    rows = generate("basic_arithmetic", cfg)
    assert [len(rows["train"]), len(rows["test"])] == [12, 5]
    from reasoning_gym.utils import SYSTEM_PROMPTS

    for split, split_rows in rows.items():
        for i, row in enumerate(split_rows):
            system, user = row["prompt"]
            assert system == {"role": "system", "content": SYSTEM_PROMPTS["direct"]}
            assert "<answer>" in system["content"] and user["role"] == "user"
            assert row["data_source"] == "reasoning_gym/basic_arithmetic"
            entry = decode_entry(row["extra_info"]["entry"])
            assert entry["question"] == user["content"]
            assert row["reward_model"] == {"style": "rule", "ground_truth": entry["answer"]}
            assert row["response"] == f"<answer>{entry['answer']}</answer>"
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            assert json.loads(row["extra_info"]["config"]) == {}
    assert generate("basic_arithmetic", cfg) == rows  # the same config, the same rows
    # No system prompt: the question alone.
    bare = generate("basic_arithmetic", ReasoningGymConfig(train_size=2, test_size=1, system_prompt=""))
    assert [m["role"] for m in bare["train"][0]["prompt"]] == ["user"]


def test_the_splits_never_share_a_question_even_where_their_seeds_collide() -> None:
    cfg = ReasoningGymConfig(train_size=20, test_size=10, seed=3, config=NARROW)
    # The two seeded streams alone would share questions: the dedup is what keeps the splits apart.
    kwargs = NARROW["lcm"]
    streams = [
        {
            reasoning_gym.create_dataset("lcm", size=30, seed=split_seed(3, "lcm", s), **kwargs)[i][
                "question"
            ]
            for i in range(30)
        }
        for s in rgt.SPLITS
    ]
    assert split_seed(3, "lcm", "train") != split_seed(3, "lcm", "test")
    assert streams[0] & streams[1], "the test needs streams that collide"
    rows = generate("lcm", cfg)
    train, test = questions(rows["train"]), questions(rows["test"])
    assert len(set(train)) == 20 and len(set(test)) == 10  # distinct within each split
    assert not set(train) & set(test)
    # The test split does not depend on the train split's size.
    assert (
        generate("lcm", ReasoningGymConfig(train_size=5, test_size=10, seed=3, config=NARROW))["test"]
        == rows["test"]
    )
    # Another seed, other questions.
    assert (
        questions(
            generate("lcm", ReasoningGymConfig(train_size=5, test_size=10, seed=4, config=NARROW))["test"]
        )
        != test
    )


def test_a_task_whose_questions_run_out_names_the_size_to_lower() -> None:
    with pytest.raises(ConfigError, match=r"train split needs 30 distinct.*reasoning_gym.train_size"):
        generate("lcm", ReasoningGymConfig(train_size=30, test_size=10, config=NARROW))


def test_the_splits_are_generated_once_and_cached_by_config(tmp_path: Path) -> None:
    cfg = ReasoningGymConfig(train_size=8, test_size=4)
    files = ["reasoning_gym:leg_counting:train", "reasoning_gym:leg_counting:test", "tiny:test"]
    train, test, tiny = resolve_data_files(
        files, tmp_path, TinyTaskConfig(num_train=8, num_test=4), rgym_cfg=cfg
    )
    assert train.parent == test.parent and train.parent.name.startswith("reasoning_gym-leg_counting-")
    assert pq.read_table(train).num_rows == 8 and pq.read_table(test).num_rows == 4
    assert tiny.name == "test.parquet" and tiny.parent != train.parent
    stamp = train.stat().st_mtime_ns
    assert write_splits(tmp_path, "leg_counting", cfg)["train"] == train
    assert train.stat().st_mtime_ns == stamp  # read from the cache, not written again
    other = write_splits(tmp_path, "leg_counting", ReasoningGymConfig(train_size=8, test_size=4, seed=1))
    assert other["train"].parent != train.parent


def test_data_source_sets_both_splits_and_task_settings_load() -> None:
    cfg = load_config(
        [
            "recipe=grpo_tiny",
            "data.source=reasoning_gym:leg_counting",
            "+reasoning_gym.config.leg_counting={max_animals: 3}",
            "reasoning_gym.train_size=50",
        ],
        import_entry_module=False,
    )
    assert cfg.data.train_files == ["reasoning_gym:leg_counting:train"]
    assert cfg.data.val_files == ["reasoning_gym:leg_counting:test"]
    section = cfg.section(ReasoningGymConfig)
    assert section.config == {"leg_counting": {"max_animals": 3}} and section.train_size == 50
    with pytest.raises(ConfigError, match=r"a new key of a mapping.*\+reasoning_gym.config.leg_counting"):
        load_config(
            ["recipe=grpo_tiny", "reasoning_gym.config.leg_counting.max_animals=3"], import_entry_module=False
        )
    with pytest.raises(ConfigError, match="a data source is reasoning_gym:<task>"):
        load_config(["recipe=grpo_tiny", "data.source=gsm8k"], import_entry_module=False)


@pytest.mark.parametrize(
    ("files", "config", "message"),
    [
        (["reasoning_gym:leg_countin:train"], {}, r"no task 'leg_countin'\. Close names: leg_counting"),
        (["reasoning_gym:composite:train"], {}, r"composite mixes tasks; list one entry per task"),
        (["reasoning_gym:leg_counting"], {}, r"names no split; use reasoning_gym:leg_counting:train"),
        (["reasoning_gym:leg_counting:val"], {}, r"has no split 'val'"),
        (
            ["reasoning_gym:leg_counting:train"],
            {"leg_counting": {"max_animal": 3, "colour": 1}},
            r"colour, max_animal \(did you mean max_animals\?\) are not settings of the task 'leg_counting'",
        ),
        (
            ["reasoning_gym:leg_counting:train"],
            {"leg_counting": {"min_animals": 5, "max_animals": 2}},
            r"the task refuses these settings \(AssertionError: max_animals must be >= min_animals\)",
        ),
        (
            ["reasoning_gym:leg_counting:train"],
            {"leg_count": {"x": 1}},
            r"settings for 'leg_count', which no data",
        ),
    ],
)
def test_bad_entries_and_settings_are_named_before_anything_is_generated(
    files: list[str], config: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        rgt.check_entries({"data.train_files": files}, ReasoningGymConfig(config=config))


def test_check_refuses_an_unknown_task_with_the_close_names(tmp_path: Path) -> None:
    res = run_train(
        ["recipe=grpo_tiny", "data.source=reasoning_gym:basic_arithmetc", "--check"], cwd=tmp_path
    )
    assert res.returncode == 2, res.stderr
    assert "reasoning-gym has no task 'basic_arithmetc'. Close names: basic_arithmetic" in res.stderr
    assert "--list" in res.stderr


def test_a_missing_package_names_the_extra() -> None:
    """The package is installed here, so a child process hides it (an import hook: "not installed" cannot
    be real in a shared environment) and checks an entry and the reward's data source."""
    code = textwrap.dedent(
        """
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "reasoning_gym":
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Hide())
        from spmdrl.data.reasoning_gym_task import ReasoningGymConfig, check_entries
        from spmdrl.rewards.registry import check_data_sources
        check_data_sources("auto", {"openai/gsm8k"})  # no reasoning-gym source: no need
        for check in (
            lambda: check_entries({"data.train_files": ["reasoning_gym:lcm:train"]}, ReasoningGymConfig()),
            lambda: check_data_sources("auto", {"reasoning_gym/lcm"}),
        ):
            try:
                check()
            except Exception as e:
                print(type(e).__name__, e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    assert "data.train_files[0]: the reasoning-gym task 'lcm'" in lines[0]
    assert "reward.fn=auto on data_source 'reasoning_gym/lcm'" in lines[1]
    for line in lines:
        assert line.startswith("ReasoningGymMissingError") and 'pip install -e ".[envs]"' in line
