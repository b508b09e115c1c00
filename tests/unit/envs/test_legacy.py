"""A verifiers 0.3.x environment as prompts and reward: tests/envs/vf_tiny_legacy (a vf.SingleTurnEnv with a
vf.Rubric), in a subprocess whose PYTHONPATH puts verifiers 0.3.1 (its legacy API) before the installed 0.4,
and the errors of a 0.3.x environment without that API, and of a load_environment that raises."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.vf_envs import LEGACY_ENV, pythonpath

SOURCE = f"verifiers:{LEGACY_ENV}"
PROBE = textwrap.dedent(
    """
    import json, sys
    from spmdrl.envs.config import EnvConfig
    from spmdrl.envs.rows import env_rows
    from spmdrl.envs.setup import env_reward, load_env
    from spmdrl.errors import ConfigError

    out = {}
    cfg = EnvConfig(source=sys.argv[1], args={"num_train": 30, "num_eval": 8}, num_val=5)
    loaded = load_env(cfg)
    out["loaded"] = [loaded.generation, loaded.multi_turn, loaded.verifiers_version, type(loaded.env).__name__]
    rows = env_rows(loaded, cfg)
    out["rows"] = [len(rows.train), len(rows.val), rows.val_from]
    out["questions"] = [[r["prompt"][-1]["content"] for r in rows.train], [r["prompt"][-1]["content"] for r in rows.val]]
    row = rows.train[0]
    gt = row["reward_model"]["ground_truth"]
    fn = env_reward(cfg)
    out["scores"] = [fn(reply, gt, data_source="", extra_info=row["extra_info"])
                     for reply in (f"#### {gt}", f"#### {int(gt) + 1}", "no answer")]
    held = EnvConfig(source=sys.argv[1], args={"num_train": 30, "eval_split": False}, num_val=5)
    held_rows = env_rows(load_env(held), held)
    out["held_out"] = [len(held_rows.train), len(held_rows.val), held_rows.val_from]
    multi = EnvConfig(source=sys.argv[1], args={"num_train": 30, "multi_turn": True})
    out["multi_turn"] = [load_env(multi).multi_turn, type(load_env(multi).env).__name__]
    for args in ({"raise_on_load": True}, {"no_such_arg": 1}):
        try:
            load_env(EnvConfig(source=sys.argv[1], args=args))
        except ConfigError as e:
            out.setdefault("errors", []).append(str(e))
    print("RESULT " + json.dumps(out))
    """
)


def _run(legacy: bool) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": pythonpath(LEGACY_ENV, legacy=legacy), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", PROBE, SOURCE], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    res = _run(legacy=True)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULT "))


def test_loads_as_a_single_turn_legacy_env(probe: dict[str, Any]) -> None:
    assert probe["loaded"] == ["legacy", False, "0.3.1", "SingleTurnEnv"]


def test_eval_dataset_validates_and_without_one_the_tail_is_held_out(probe: dict[str, Any]) -> None:
    assert probe["rows"] == [30, 5, "eval dataset"]
    train, val = probe["questions"]
    assert not set(train) & set(val)  # the tiny task's held-out questions
    assert probe["held_out"] == [25, 5, "held out of the dataset"]


def test_rubric_functions_weighted_and_each_in_the_breakdown(probe: dict[str, Any]) -> None:
    right, wrong, none = probe["scores"]
    # correct_answer (weight 1), has_answer (weight 0.1), and MultiTurnEnv's num_turns metric (weight 0).
    assert right == {"score": pytest.approx(1.1), "correct_answer": 1.0, "has_answer": 1.0, "num_turns": 1.0}
    assert wrong == {"score": pytest.approx(0.1), "correct_answer": 0.0, "has_answer": 1.0, "num_turns": 1.0}
    assert none == {"score": 0.0, "correct_answer": 0.0, "has_answer": 0.0, "num_turns": 1.0}


def test_a_multi_turn_env_is_told_apart(probe: dict[str, Any]) -> None:
    assert probe["multi_turn"] == [True, "RetryEnv"]


def test_load_environment_raising_names_the_env_and_the_cause(probe: dict[str, Any]) -> None:
    raised, bad_arg = probe["errors"]
    assert SOURCE in raised and "load_environment(raise_on_load=True) raised RuntimeError" in raised
    assert "the task server is unreachable" in raised
    assert "TypeError" in bad_arg and "no_such_arg" in bad_arg


def test_without_the_legacy_api_the_error_says_what_to_install() -> None:
    res = _run(legacy=False)
    assert res.returncode != 0
    assert "is a verifiers 0.3.x environment" in res.stderr and "verifiers==0.3.1" in res.stderr, res.stderr[
        -2000:
    ]
