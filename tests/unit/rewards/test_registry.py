"""The reward-function registry (spmdrl/rewards/registry.py) and how the sandbox runs what it loads:
built-in specs, user functions by file or module path, workers that time out or crash."""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

from spmdrl.config import Config, ConfigError, RewardConfig, validate
from spmdrl.imports import import_file
from spmdrl.rewards.registry import REWARD_FNS, RewardInput, UnknownDataSourceError, load_reward_fn
from spmdrl.rewards.sandbox import score_batch

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


# ---------------------------------------------------------------------------------------------- registry

USER_REWARDS = """
import math
import os
import time

CONST = 3


def score(response, ground_truth, *, data_source, extra_info):
    return {"score": float(response.strip() == ground_truth), "length": float(len(response))}


def positional_only(response, ground_truth):
    return 1.0


def raises(response, ground_truth, *, data_source, extra_info):
    if response == "bad":
        raise ValueError("boom: cannot parse " + response)
    return 1.0


def hangs(response, ground_truth, *, data_source, extra_info):
    if response == "hang":
        with open(extra_info["pid_file"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(30)
    return 1.0


def odd_values(response, ground_truth, *, data_source, extra_info):
    return {
        "nan": math.nan,
        "inf": math.inf,
        "str": "1.0",
        "none": None,
        "no_score_key": {"acc": 1.0},
        "bad_extra": {"score": 1.0, "note": "good"},
        "dict": {"score": 0.5, "acc": 1.0},
        "bool": True,
    }[response]


def exits(response, ground_truth, *, data_source, extra_info):
    if response == "exit":
        os._exit(3)
    return 1.0
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def _call(fn, response, gt="19", data_source="spmdrl/tiny_arith"):
    return fn(response, gt, data_source=data_source, extra_info={})


def test_builtin_specs():
    for spec in ("gsm8k", "tiny", "auto"):
        fn = load_reward_fn(spec)
        assert fn.trusted and fn.spec == spec
    assert _call(load_reward_fn("tiny"), "12 + 7 = 19\n#### 19") == 1.0
    assert _call(load_reward_fn("gsm8k"), GSM8K_SOLUTION, "72", "openai/gsm8k") == 1.0


def test_auto_dispatches_by_data_source():
    auto = load_reward_fn("auto")
    assert _call(auto, GSM8K_SOLUTION, "72", "openai/gsm8k") == 1.0
    assert _call(auto, "#### 19", "19", "spmdrl/tiny_arith") == 1.0
    assert _call(auto, "#### 18", "19", "spmdrl/tiny_arith") == 0.0
    with pytest.raises(UnknownDataSourceError, match="'codecontests'.*set reward.fn"):
        _call(auto, "#### 1", "1", "codecontests")


def test_user_function_from_file(user_file: Path, monkeypatch):
    fn = load_reward_fn(f"{user_file}:score")
    assert not fn.trusted
    assert _call(fn, "19") == {"score": 1.0, "length": 2.0}
    # A relative path is resolved against the working directory, and the spec made absolute.
    monkeypatch.chdir(user_file.parent)
    rel = load_reward_fn("user_rewards.py:score")
    assert rel.spec == f"{user_file}:score"
    assert rel.fn is fn.fn  # one module per file, loaded once
    # It pickles as its spec, which is how worker processes get it.
    again = pickle.loads(pickle.dumps(rel))
    assert again.spec == rel.spec and _call(again, "18")["score"] == 0.0


def test_user_function_from_module_path(tmp_path: Path, monkeypatch):
    pkg = tmp_path / "spmdrl_test_user_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("spmdrl_test_user_pkg.rewards:score")
    assert fn.spec == "spmdrl_test_user_pkg.rewards:score"
    assert _call(fn, "19")["score"] == 1.0


def test_reward_fn_is_checked_at_config_load(user_file: Path):
    validate(Config(reward=RewardConfig(fn=f"{user_file}:score")))
    with pytest.raises(
        ConfigError, match=r"reward.fn='tiny_tool': unknown reward function.*Registered: gsm8k"
    ):
        validate(Config(reward=RewardConfig(fn="tiny_tool")))
    with pytest.raises(ConfigError, match="has no attribute 'scor'"):
        validate(Config(reward=RewardConfig(fn=f"{user_file}:scor")))
    # The signature of a reward function is checked when it is named.
    with pytest.raises(ConfigError, match=r"does not take the arguments of a reward function.*data_source"):
        validate(Config(reward=RewardConfig(fn=f"{user_file}:positional_only")))


def test_a_decorated_reward_fn_by_name_runs_in_a_worker_that_imports_its_file(tmp_path: Path):
    # As in a forked recipe file: the entry file (loaded by path) registers its own reward.
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(
        "import os\n"
        "from spmdrl.rewards.registry import register_reward_fn\n"
        "@register_reward_fn('spmdrl_test_pid')\n"
        "def pid_score(response, ground_truth, *, data_source, extra_info):\n"
        "    return {'score': float(response == ground_truth), 'pid': float(os.getpid())}\n"
    )
    import_file(recipe, label="entry")
    try:
        validate(Config(reward=RewardConfig(fn="spmdrl_test_pid")))
        fn = load_reward_fn("spmdrl_test_pid")
        assert not fn.trusted and fn.spec == f"{recipe.resolve()}:pid_score"  # how a worker imports it
        result = score_batch(fn, _inputs("19", "7"), timeout_s=30, error_score=-1, batch_timeout_s=60)
        assert result.scores_B.tolist() == [1.0, 0.0]
        assert result.extra["pid"][0] != float(os.getpid())  # scored in a worker process
    finally:
        REWARD_FNS.unregister("spmdrl_test_pid")


def test_bad_specs(user_file: Path, tmp_path: Path, monkeypatch):
    with pytest.raises(ConfigError, match="reward.fn='gsm9k': unknown reward function. Did you mean 'gsm8k'"):
        load_reward_fn("gsm9k")
    with pytest.raises(ConfigError, match="no module named 'spmdrl_no_such_pkg'.*PYTHONPATH"):
        load_reward_fn("spmdrl_no_such_pkg.mod:score")
    with pytest.raises(ConfigError, match="no such file"):
        load_reward_fn(f"{tmp_path}/missing.py:score")
    with pytest.raises(ConfigError, match="has no attribute 'scor'.*score"):
        load_reward_fn(f"{user_file}:scor")
    with pytest.raises(ConfigError, match="'CONST' is a int, not a function"):
        load_reward_fn(f"{user_file}:CONST")
    # A module that exists but whose own import fails is reported as that, not as "no module".
    (tmp_path / "spmdrl_test_broken_dep.py").write_text("import spmdrl_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing 'spmdrl_test_broken_dep' failed"):
        load_reward_fn("spmdrl_test_broken_dep:score")
    (tmp_path / "crashes.py").write_text("raise RuntimeError('bad top level')\n")
    with pytest.raises(ConfigError, match="RuntimeError: bad top level"):
        load_reward_fn(f"{tmp_path}/crashes.py:score")


# ---------------------------------------------------------------------------------------------- sandbox


def _inputs(*responses: str, **extra_info) -> list[RewardInput]:
    return [RewardInput(r, "19", "spmdrl/tiny_arith", dict(extra_info), prompt="12 + 7 =") for r in responses]


def test_trusted_builtin_runs_inline():
    result = score_batch(
        load_reward_fn("tiny"), _inputs("#### 19", "#### 18", "19"), timeout_s=1, error_score=-1
    )
    assert result.scores_B.dtype == torch.float32
    assert result.scores_B.tolist() == [1.0, 0.0, 0.0]
    assert (result.num_errors, result.num_timeouts, result.extra) == (0, 0, {})


def test_trusted_inline_catches_errors_and_logs_the_first(caplog):
    def flaky(response, ground_truth, *, data_source, extra_info):
        if response.startswith("bad"):
            raise KeyError(response)
        return 1.0

    with caplog.at_level(logging.WARNING, logger="spmdrl.rewards.sandbox"):
        result = score_batch(flaky, _inputs("ok", "bad1", "bad2"), timeout_s=1, error_score=-1, trusted=True)
    assert result.scores_B.tolist() == [1.0, -1.0, -1.0]
    assert result.num_errors == 2
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "2 of 3 samples failed" in text and "KeyError: 'bad1'" in text
    assert "bad2" not in text  # only the first failure's traceback


def test_auto_on_unknown_data_source_ends_the_run():
    inputs = [RewardInput("#### 1", "1", "my/dataset", {}, "")]
    with pytest.raises(UnknownDataSourceError, match="my/dataset"):
        score_batch(load_reward_fn("auto"), inputs, timeout_s=1, error_score=0.0)


def test_worker_scores_dicts_and_counts_errors(user_file: Path, caplog):
    result = score_batch(load_reward_fn(f"{user_file}:score"), _inputs("19", "7"), timeout_s=5, error_score=0)
    assert result.scores_B.tolist() == [1.0, 0.0]
    assert result.extra == {"length": [2.0, 1.0]}

    with caplog.at_level(logging.WARNING, logger="spmdrl.rewards.sandbox"):
        result = score_batch(
            load_reward_fn(f"{user_file}:raises"), _inputs("a", "bad", "b"), timeout_s=5, error_score=-2
        )
    assert result.scores_B.tolist() == [1.0, -2.0, 1.0]
    assert (result.num_errors, result.num_timeouts) == (1, 0)
    assert "ValueError: boom: cannot parse bad" in caplog.text


def test_worker_rejects_non_finite_and_non_numeric(user_file: Path, caplog):
    responses = ["nan", "inf", "str", "none", "no_score_key", "bad_extra", "dict", "bool"]
    with caplog.at_level(logging.WARNING, logger="spmdrl.rewards.sandbox"):
        result = score_batch(
            load_reward_fn(f"{user_file}:odd_values"), _inputs(*responses), timeout_s=5, error_score=-1
        )
    # A non-numeric extra (verl DAPO's "pred" string) is skipped, not an error: the sample keeps its score.
    assert result.scores_B.tolist() == [-1.0] * 5 + [1.0, 0.5, 1.0]
    assert result.num_errors == 5
    assert "note" not in result.extra
    acc = result.extra["acc"]
    assert acc[6] == 1.0 and all(v != v for i, v in enumerate(acc) if i != 6)  # NaN where absent
    # The message names the function and what it returned.
    assert f"{user_file}:odd_values returned float nan for sample 0" in caplog.text


def test_worker_timeout_returns_promptly_and_kills_the_call(user_file: Path, tmp_path: Path):
    fn = load_reward_fn(f"{user_file}:hangs")
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    result = score_batch(fn, _inputs("a", "hang", "b", pid_file=str(pid_file)), timeout_s=0.5, error_score=-1)
    elapsed = time.monotonic() - start
    assert elapsed < 2.5, f"took {elapsed:.1f} s"
    assert result.scores_B.tolist() == [1.0, -1.0, 1.0]
    assert (result.num_errors, result.num_timeouts) == (0, 1)
    # The worker stuck in time.sleep(30) is gone (killed and reaped), not left running.
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    # The pool replaced it: the next call works.
    result = score_batch(fn, _inputs("c", "d"), timeout_s=5, error_score=-1)
    assert result.scores_B.tolist() == [1.0, 1.0]


def test_worker_crash_is_an_error_not_a_hang(user_file: Path):
    fn = load_reward_fn(f"{user_file}:exits")
    result = score_batch(fn, _inputs("a", "exit", "b"), timeout_s=5, error_score=-1, num_workers=1)
    assert result.scores_B.tolist() == [1.0, -1.0, 1.0]
    assert (result.num_errors, result.num_timeouts) == (1, 0)


def test_unpicklable_function_is_refused_clearly():
    with pytest.raises(ConfigError, match="cannot be sent to a worker process"):
        score_batch(lambda *a, **k: 1.0, _inputs("a"), timeout_s=1, error_score=0)
