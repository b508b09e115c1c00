"""A verifiers 0.4 (verifiers.v1) taskset as prompts and reward: tests/envs/vf_tiny_v1, imported in this
process (verifiers 0.4 is the installed one), scored in-process and in the real reward workers."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

from spmdrl.envs.config import EnvConfig
from spmdrl.envs.load import V1
from spmdrl.envs.rows import TASK_KEY, env_rows
from spmdrl.envs.setup import check_env, env_reward, forget_loaded, load_env
from spmdrl.errors import ConfigError
from tests.vf_envs import ENVS_DIR, V1_ENV

pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (the envs extra)")
SOURCE = f"verifiers:{V1_ENV}"


@pytest.fixture(autouse=True)
def v1_env_on_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The workers get this process's sys.path (spmdrl.rewards.sandbox_worker), so they import it too.
    monkeypatch.syspath_prepend(str(ENVS_DIR / V1_ENV))
    yield
    forget_loaded()


def _reply(answer: str) -> str:
    return f"1 + 1 = {answer}\n#### {answer}"


def test_taskset_loads_as_single_turn_v1_with_a_held_out_split() -> None:
    cfg = EnvConfig(source=SOURCE, args={"num_tasks": 50}, num_train=30, num_val=10)
    loaded = load_env(cfg)
    assert (loaded.generation, loaded.multi_turn, loaded.name) == (V1, False, V1_ENV)
    assert type(loaded.env).__name__ == "TinyTaskset"
    rows = env_rows(loaded, cfg)
    assert (len(rows.train), len(rows.val), rows.val_from) == (30, 10, "held out of the dataset")
    # The last 10 tasks validate, none of them trains.
    train_idx = {json.loads(r["extra_info"][TASK_KEY])["idx"] for r in rows.train}
    val_idx = {json.loads(r["extra_info"][TASK_KEY])["idx"] for r in rows.val}
    assert val_idx == set(range(40, 50)) and train_idx == set(range(30))
    row = rows.train[0]
    assert row["data_source"] == SOURCE and row["prompt"][0]["role"] == "user"
    assert row["reward_model"]["ground_truth"] == json.loads(row["extra_info"][TASK_KEY])["answer"]


def test_reward_is_the_weighted_rewards_with_each_in_the_breakdown() -> None:
    cfg = EnvConfig(source=SOURCE, args={"num_tasks": 12}, num_val=2)
    row = env_rows(load_env(cfg), cfg).train[3]
    answer, extra = row["reward_model"]["ground_truth"], row["extra_info"]
    fn = env_reward(cfg)
    right = fn(_reply(answer), answer, data_source=SOURCE, extra_info=extra)
    wrong = fn(_reply(str(int(answer) + 1)), answer, data_source=SOURCE, extra_info=extra)
    none = fn("no idea", answer, data_source=SOURCE, extra_info=extra)
    assert right == {"score": 1.0, "correct_answer": 1.0, "has_answer": 1.0}
    assert wrong == {"score": 0.0, "correct_answer": 0.0, "has_answer": 1.0}
    assert none == {"score": 0.0, "correct_answer": 0.0, "has_answer": 0.0}


def test_bad_args_and_a_missing_package_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"(?s)env.args do not fit TinyTasksetConfig.*num_taskz"):
        load_env(EnvConfig(source=SOURCE, args={"num_taskz": 3}))
    with pytest.raises(ConfigError, match=r"no environment package 'no-such-env' is installed.*pip install"):
        load_env(EnvConfig(source="verifiers:no-such-env"))
    with pytest.raises(ConfigError, match=r"<kind>:<name>"):
        EnvConfig(source="no_such_kind:x")


def test_verifiers_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers raises ImportError
    with pytest.raises(ConfigError, match=r'needs the verifiers package.*pip install -e "\.\[envs\]"'):
        load_env(EnvConfig(source=SOURCE))


def test_check_refuses_a_reward_fn_beside_the_environment() -> None:
    cfg = EnvConfig(source=SOURCE, args={"num_tasks": 12}, num_val=2)
    assert check_env(cfg).endswith("10 training prompts, 2 validation prompts (held out of the dataset)")
    with pytest.raises(ConfigError, match=r"reward.fn=gsm8k would be ignored"):
        check_env(cfg, reward_fn="gsm8k")
