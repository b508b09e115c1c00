"""The stop on reward.max_error_frac (spmdrl/rl/samples.py::check_reward_errors) names the source of the
samples that got no score: reward.fn (errors, timeouts) and the judge (replies that did not parse), each
with its count and fix; a sample failed by both counts once. The judge's counts come from a real Judge on
a real in-process vLLM engine (the tiny model, on the CPU) in tests/integration/test_judge_error_counts.py."""

from __future__ import annotations

import pytest
import torch

from spmdrl.config import (
    Config,
    FilterGroupsConfig,
    JudgeConfig,
    RewardConfig,
    RewardModelConfig,
)
from spmdrl.data.prompts import PromptExample
from spmdrl.rewards.registry import RewardFn, RewardInput
from spmdrl.rewards.sandbox import RewardResult, score_batch
from spmdrl.rl.samples import DynamicSampling, ScoredSamples, check_reward_errors
from spmdrl.rl.settings import reward_settings
from spmdrl.rollout.engine import Generation
from spmdrl.testing.spawn import run_distributed

CPU = torch.device("cpu")
REGEX = r"QQQ(\d)"  # never in the tiny model's replies: every judge reply fails to parse


def _cfg(max_error_frac: float = 0.25) -> Config:
    return Config(
        reward=RewardConfig(fn="mine", max_error_frac=max_error_frac),
        reward_model=RewardModelConfig(judge=JudgeConfig(enable=True, score_regex=REGEX, max_tokens=7)),
    )


def _stop(cfg: Config, rewards: RewardResult) -> str:
    with pytest.raises(RuntimeError) as e:
        check_reward_errors(reward_settings(cfg), rewards, step=3, device=CPU)
    return str(e.value)


def test_reward_fn_alone_keeps_its_wording() -> None:
    msg = _stop(_cfg(), RewardResult(torch.zeros(8), 2, 1))
    assert msg.startswith("step 3: 3 of 8 samples (38%) got no score from reward.fn=mine (1 timed out, ")
    assert "fix the function (or raise reward.max_error_frac)" in msg
    assert "judge" not in msg


def test_judge_alone_is_named_with_its_fix() -> None:
    rewards = RewardResult(torch.zeros(8), 5, 0, num_judge_errors=5, num_judge_only=5)
    msg = _stop(_cfg(), rewards)
    assert msg.startswith("step 3: 5 of 8 samples (62%) got no score, above reward.max_error_frac=0.25 (or")
    assert "5 judge replies that did not parse (reward_model.judge.*)" in msg
    assert f"score_regex={REGEX!r}" in msg and "reward_model.judge.max_tokens=7" in msg
    assert "reward.fn" not in msg and "fix the function" not in msg


def test_both_sources_each_with_a_count_a_sample_failed_twice_once() -> None:
    # reward.fn: 2 errors + 1 timeout; the judge: 5 unparsed, 2 of them on samples reward.fn had failed.
    rewards = RewardResult(torch.zeros(8), 2 + 3, 1, num_judge_errors=5, num_judge_only=3)
    assert rewards.num_fn_failed == 3
    msg = _stop(_cfg(), rewards)
    assert msg.startswith("step 3: 6 of 8 samples (75%) got no score, above reward.max_error_frac=0.25 (or")
    assert "3 from reward.fn=mine (1 timed out, " in msg and "fix the function" in msg
    assert "5 judge replies that did not parse (reward_model.judge.*; 2 of them on samples reward.fn" in msg
    lines = msg.splitlines()  # one line per source, reward.fn's first
    assert len(lines) == 3 and "reward.fn" in lines[1] and "judge" in lines[2] and "judge" not in lines[1]
    # Under the limit nothing stops, judge failures included.
    check_reward_errors(reward_settings(_cfg(max_error_frac=0.75)), rewards, step=3, device=CPU)


def _two_ranks(rank: int, world: int) -> str:
    # Rank 0: reward.fn failed 2 of its 4; rank 1: the judge 3 of its 4. 5 of 8 over the world.
    rewards = (
        RewardResult(torch.zeros(4), 2, 0)
        if rank == 0
        else RewardResult(torch.zeros(4), 3, 0, num_judge_errors=3, num_judge_only=3)
    )
    try:
        check_reward_errors(reward_settings(_cfg()), rewards, step=2, device=CPU)
    except RuntimeError as e:
        return str(e)
    return ""


def test_the_sources_are_summed_over_ranks_and_every_rank_stops() -> None:
    msgs = run_distributed(_two_ranks, 2, timeout_s=120)
    assert msgs[0] == msgs[1] and msgs[0].startswith("step 2: 5 of 8 samples (62%) got no score, above"), msgs
    assert "  - 2 from reward.fn=mine" in msgs[0] and "  - 3 judge replies that did not parse" in msgs[0]


def _raises_on_bad(response: str, ground_truth: str, *, data_source: str, extra_info: dict) -> float:
    if response == "bad":
        raise ValueError("a bad sample")
    return 1.0


def test_score_batch_marks_the_samples_reward_fn_failed() -> None:
    fn = RewardFn("test:raises_on_bad", _raises_on_bad, trusted=True)
    inputs = [RewardInput(r, "", "src", {}) for r in ("ok", "bad", "ok", "bad")]
    result = score_batch(fn, inputs, timeout_s=5, error_score=0.0)
    assert result.failed_B is not None and result.failed_B.tolist() == [False, True, False, True]
    assert (result.num_errors, result.num_fn_failed, result.num_judge_errors) == (2, 2, 0)


def _batch(judge_errors: int, judge_only: int, errors: int) -> ScoredSamples:
    prompts = [PromptExample(i, [1], [], str(i), "src", {}) for i in range(2)]
    raw_B = torch.tensor([1.0, 0.0, 1.0, 0.0])
    gens = [Generation(i // 2, [5], [0.0], "stop") for i in range(4)]
    rewards = RewardResult(raw_B, errors, 0, num_judge_errors=judge_errors, num_judge_only=judge_only)
    return ScoredSamples(prompts, gens, rewards, ["x"] * 4, raw_B.clone())


def test_dynamic_sampling_keeps_the_judge_counts_of_every_batch() -> None:
    fg = FilterGroupsConfig(enable=True, metric="reward", max_num_gen_batches=0)
    dyn = DynamicSampling(fg, 2, 1, CPU)
    dyn.add(_batch(judge_errors=2, judge_only=1, errors=3))
    dyn.add(_batch(judge_errors=1, judge_only=1, errors=1))
    kept = dyn.kept().rewards
    assert (kept.num_errors, kept.num_judge_errors, kept.num_judge_only, kept.num_fn_failed) == (4, 3, 2, 2)


# ---------------------------------------------------------------------------------------------- real judge


def test_an_environments_failed_trajectories_are_charged_once_and_named() -> None:
    from spmdrl.rl.samples import charge_env_failures
    from spmdrl.rollout.engine import TrajectoryInfo

    ends = ["stop", "env_error", "env_timeout", "env_rewrite", None]
    gens = [
        Generation(
            0, [1], [0.0], "length", trajectory=None if e is None else TrajectoryInfo(terminate_reason=e)
        )
        for e in ends
    ]
    # The rubric had failed on the env_timeout sample already: it counts once.
    failed_B = torch.tensor([False, False, True, False, False])
    rewards = RewardResult(torch.tensor([1.0, 1.0, -1.0, 0.5, 1.0]), 1, 0, failed_B=failed_B)
    charged = charge_env_failures(rewards, gens, error_score=-1.0)
    assert charged.scores_B.tolist() == [1.0, -1.0, -1.0, -1.0, 1.0]
    assert (charged.num_errors, charged.num_env_errors) == (3, 3)
    assert charged.failed_B.tolist() == [False, True, True, True, False]
    msg = _stop(Config(reward=RewardConfig(max_error_frac=0.25)), charged)
    assert msg.startswith("step 3: 3 of 5 samples (60%) got no score from the environment (env.source): 3 ")
    assert "rollout.multi_turn.tool_timeout_s" in msg
    # Nothing to charge: the same result back.
    assert charge_env_failures(rewards, [gens[0], gens[4]] * 2 + [gens[0]], -1.0) is rewards
