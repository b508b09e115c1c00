"""spmdrl/rl/samples.py: a step's sampling seeds, scoring generations with a real tokenizer and reward
function, DAPO's overlong shaping and dynamic sampling as the rollout phase drives them, the reward-error
stop, the samples to log; and, on 2 gloo ranks, that their decisions and metrics are the whole world's
(on 3, that dynamic sampling decides over its group only: the rollout ranks of parallel.placement=async).

The formulas themselves (overlong_penalty, groups_with_signal, should_generate_more) are tested in
tests/unit/algos/test_dapo.py; here: what this module builds on them (which reward shaping adds to, which
metric the filter reads, what survives across generation batches, what every rank agrees on).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from spmdrl.config import (
    AlgorithmConfig,
    Config,
    DataConfig,
    FilterGroupsConfig,
    LoggingConfig,
    OverlongBufferConfig,
    RewardConfig,
    RolloutConfig,
)
from spmdrl.data.prompts import PromptExample
from spmdrl.rewards.registry import RewardFn
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.samples import (
    DynamicSampling,
    OverlongShaping,
    ScoredSamples,
    check_reward_errors,
    score,
    train_samples,
    train_sampling,
)
from spmdrl.rl.settings import reward_settings
from spmdrl.rollout.engine import Generation, TrajectoryInfo
from spmdrl.testing.spawn import run_distributed

CPU = torch.device("cpu")
N = 2  # rollout.n


def _prompt(name: str, index: int = 0) -> PromptExample:
    return PromptExample(index, [1, 2, 3], [], ground_truth=f"gt-{name}", data_source="test", extra_info={})


def _samples(
    names: list[str],
    raw: list[float],
    shaped: list[float] | None = None,
    lengths: list[int] | None = None,
    extra: dict[str, list[float]] | None = None,
    errors: int = 0,
    timeouts: int = 0,
    tag: int = 0,
) -> ScoredSamples:
    """A generation batch: rollout.n samples per prompt; each row's tokens and response name it."""
    rows = len(names) * N
    lengths = lengths or [3] * rows
    gens = [
        Generation(i // N, [tag * 100 + i] * lengths[i], [-0.1] * lengths[i], "stop") for i in range(rows)
    ]
    raw_B = torch.tensor(raw)
    return ScoredSamples(
        prompts=[_prompt(p) for p in names],
        gens=gens,
        rewards=RewardResult(raw_B, errors, timeouts, extra or {}),
        responses=[f"{names[i // N]}/{i % N}" for i in range(rows)],
        scores_B=raw_B.clone() if shaped is None else torch.tensor(shaped),
    )


def _shaping_cfg() -> Config:
    return Config(
        rollout=RolloutConfig(n=N),
        data=DataConfig(max_response_length=10),
        reward=RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=4, penalty_factor=0.5)),
    )


def _dynamic_cfg(metric: str = "reward", max_batches: int = 0) -> Config:
    fg = FilterGroupsConfig(enable=True, metric=metric, max_num_gen_batches=max_batches)
    return Config(rollout=RolloutConfig(n=N), algorithm=AlgorithmConfig(filter_groups=fg))


# ---------------------------------------------------------------------------------------------- sampling, scoring


def test_train_sampling_seeds_each_batch_of_each_step() -> None:
    cfg = Config(rollout=RolloutConfig(n=N, seed=3), data=DataConfig(max_response_length=17))
    spec = train_sampling(cfg.rollout, cfg.data.max_response_length, step=5, gen_batch=2)
    assert spec.seed == (3 * 1_000_003 + 5) * 1_000 + 1 and spec.max_tokens == 17
    seeds = {
        train_sampling(cfg.rollout, cfg.data.max_response_length, s, b).seed
        for s in range(1, 20)
        for b in range(1, 6)
    }
    assert len(seeds) == 19 * 5
    assert (
        train_sampling(cfg.rollout, cfg.data.max_response_length, 5, 2) == spec
    )  # reproducible (a resumed run samples the same)


def test_score_decodes_and_scores_each_generation_against_its_prompt() -> None:
    from spmdrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    seen: list[tuple[str, str, dict]] = []

    def reward(response: str, ground_truth: str, *, data_source: str, extra_info: dict) -> float:
        seen.append((response, ground_truth, dict(extra_info)))
        return float(response.endswith(ground_truth)) + 0.1 * extra_info.get("tool_calls", 0)

    fn = RewardFn("test:endswith", reward, trusted=True)  # inline, as the built-in rules run
    prompts = [
        PromptExample(0, [1], [], "19", "tiny", {"k": "a"}),
        PromptExample(1, [1], [], "42", "tiny", {"k": "b"}),
    ]
    texts = ["12 + 7 = 19", "no", "6 * 7 = 42", "40 + 2 = 41"]
    gens = [
        Generation(i // 2, tok(t, add_special_tokens=False).input_ids, [], "stop")
        for i, t in enumerate(texts)
    ]
    # A multi-turn trajectory's counts reach the reward function next to the prompt's extra_info.
    gens[2] = Generation(
        1, gens[2].token_ids, [], "stop", trajectory=TrajectoryInfo(num_turns=2, tool_calls=3)
    )
    out = score(RewardConfig(), fn, tok, prompts, gens)
    assert out.responses == texts
    assert [s[1] for s in seen] == ["19", "19", "42", "42"]
    assert seen[0][2] == {"k": "a"} and seen[2][2]["k"] == "b" and seen[2][2]["num_turns"] == 2
    assert out.scores_B.tolist() == pytest.approx([1.0, 0.0, 1.3, 0.0])
    assert torch.equal(out.scores_B, out.rewards.scores_B) and out.rewards.num_errors == 0
    assert out.prompts is prompts and out.gens is gens and out.metrics == {}


def test_train_samples_logs_the_first_with_their_training_reward() -> None:
    from spmdrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    samples = _samples(["a", "b"], raw=[1.0, 0.0, 1.0, 1.0], shaped=[1.0, 0.0, 0.5, 1.0])
    prompt_ids = tok("12 + 7 =", add_special_tokens=False).input_ids
    samples.prompts[1] = PromptExample(1, prompt_ids, [], "19", "tiny", {})
    cfg = Config(rollout=RolloutConfig(n=N), logging=LoggingConfig(samples_per_log=3))
    logged = train_samples(4, tok, samples, cfg.logging.samples_per_log)
    assert [(s.response, s.reward, s.ground_truth) for s in logged] == [
        ("a/0", 1.0, "gt-a"),
        ("a/1", 0.0, "gt-a"),
        ("b/0", 0.5, "19"),  # the shaped reward, not the raw score
    ]
    assert logged[2].prompt == "12 + 7 =" and logged[2].step == 4 and logged[2].split == "train"


# ---------------------------------------------------------------------------------------------- overlong shaping


def test_overlong_shaping_adds_the_penalty_to_the_training_reward_only() -> None:
    shaping = OverlongShaping(
        _shaping_cfg().reward.overlong_buffer, _shaping_cfg().data.max_response_length, CPU
    )
    # Buffer: the last 4 of 10 tokens; 0 up to 6 tokens, then down to -0.5 at 10.
    s = shaping(_samples(["a", "b"], raw=[1.0, 0.0, 1.0, 1.0], lengths=[5, 6, 8, 10]))
    assert s.scores_B.tolist() == pytest.approx([1.0, 0.0, 0.75, 0.5])
    assert s.rewards.scores_B.tolist() == [1.0, 0.0, 1.0, 1.0]  # the reward function's scores stay
    shaping(_samples(["c"], raw=[0.0, 0.0], lengths=[9, 3]))
    # Every batch's penalties count (a dropped group's too): 0, 0, -0.25, -0.5, -0.375, 0.
    m = shaping.metrics()
    assert m == pytest.approx({"reward/overlong_penalty_mean": -1.125 / 6, "reward/overlong_frac": 3 / 6})
    assert OverlongShaping(
        _shaping_cfg().reward.overlong_buffer, _shaping_cfg().data.max_response_length, CPU
    ).metrics() == {
        "reward/overlong_penalty_mean": 0.0,
        "reward/overlong_frac": 0.0,
    }


# ---------------------------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_keeps_groups_with_signal_until_enough() -> None:
    dyn = DynamicSampling(
        _dynamic_cfg().algorithm.filter_groups, _dynamic_cfg().rollout.n, step=3, device=CPU
    )
    # a: all 1, c: all 0 (dropped); b differs (kept).
    dyn.add(_samples(["a", "b", "c"], raw=[1, 1, 0, 1, 0, 0], errors=1, tag=1))
    assert (dyn.target, dyn.batches, dyn.generated, dyn.dropped) == (3, 1, 3, 2)
    assert not dyn.enough()  # 1 of 3 kept
    # All three differ; only the first two fit the step. Extra reward keys only in this batch.
    dyn.add(
        _samples(
            ["d", "e", "f"], raw=[1, 0, 0.5, 1, 0, 1], extra={"acc": [1, 0, 0, 1, 0, 1]}, timeouts=2, tag=2
        )
    )
    assert dyn.enough()
    kept = dyn.kept()
    assert [p.ground_truth for p in kept.prompts] == ["gt-b", "gt-d", "gt-e"]
    # Rows follow their group, renumbered to the kept prompts.
    assert [g.prompt_index for g in kept.gens] == [0, 0, 1, 1, 2, 2]
    assert [g.token_ids[0] for g in kept.gens] == [102, 103, 200, 201, 202, 203]
    assert kept.responses == ["b/0", "b/1", "d/0", "d/1", "e/0", "e/1"]
    assert kept.rewards.scores_B.tolist() == [0.0, 1.0, 1.0, 0.0, 0.5, 1.0]
    assert kept.scores_B.tolist() == [0.0, 1.0, 1.0, 0.0, 0.5, 1.0]
    acc = kept.rewards.extra["acc"]
    assert math.isnan(acc[0]) and math.isnan(acc[1]) and acc[2:] == [1, 0, 0, 1]
    # The failure counts are the whole step's, over both batches.
    assert (kept.rewards.num_errors, kept.rewards.num_timeouts) == (1, 2)


def test_dynamic_sampling_keeps_each_samples_token_versions() -> None:
    """rollout.partial under parallel.placement=async: a weight switch lands in some generation batch;
    the kept samples keep their own per-token versions and interrupted flags (which the rows carry)."""
    dyn = DynamicSampling(
        _dynamic_cfg().algorithm.filter_groups, _dynamic_cfg().rollout.n, step=2, device=CPU
    )
    first = _samples(["a", "b"], raw=[1, 1, 0, 1])  # a: dropped; b: kept, switched mid-generation
    first.gens = [
        dataclasses.replace(g, versions=[1, 1, 2][: len(g.token_ids)], interrupted=True) for g in first.gens
    ]
    dyn.add(first)
    second = _samples(["c", "d"], raw=[0, 1, 1, 1], tag=1)  # after the switch: all version 2; d dropped
    second.gens = [dataclasses.replace(g, versions=[2] * len(g.token_ids)) for g in second.gens]
    dyn.add(second)
    kept = dyn.kept()
    assert [p.ground_truth for p in kept.prompts] == ["gt-b", "gt-c"]
    assert [(g.versions, g.interrupted) for g in kept.gens] == [
        ([1, 1, 2], True),
        ([1, 1, 2], True),
        ([2, 2, 2], False),
        ([2, 2, 2], False),
    ]


@pytest.mark.parametrize(
    ("metric", "kept"),
    [("reward", ["p", "q"]), ("seq_final_reward", ["p", "q"]), ("score", ["q"]), ("acc", [])],
)
def test_dynamic_sampling_filters_on_the_configured_metric(metric: str, kept: list[str]) -> None:
    # p: both scored 1 but one was shaped down (overlong); q: different scores, both below 1.
    samples = _samples(["p", "q"], raw=[1.0, 1.0, 0.5, 0.2], shaped=[1.0, 0.5, 0.5, 0.2])
    dyn = DynamicSampling(
        _dynamic_cfg(metric).algorithm.filter_groups, _dynamic_cfg(metric).rollout.n, step=1, device=CPU
    )
    dyn.add(samples)
    out = dyn.kept()
    assert [p.ground_truth for p in out.prompts] == [f"gt-{k}" for k in kept]
    assert dyn.dropped == 2 - len(kept)
    if metric == "reward":  # the kept rows keep their shaped rewards and their raw scores
        assert out.scores_B.tolist() == pytest.approx([1.0, 0.5, 0.5, 0.2])
        assert out.rewards.scores_B.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.2])


def test_dynamic_sampling_stops_after_max_num_gen_batches() -> None:
    dyn = DynamicSampling(
        _dynamic_cfg(max_batches=2).algorithm.filter_groups,
        _dynamic_cfg(max_batches=2).rollout.n,
        step=7,
        device=CPU,
    )
    dyn.add(_samples(["a"], raw=[1, 1]))
    assert not dyn.enough()
    dyn.add(_samples(["b"], raw=[0, 0]))
    with pytest.raises(RuntimeError, match=r"^step 7: .*max_num_gen_batches=2"):
        dyn.enough()


# ---------------------------------------------------------------------------------------------- reward errors


def test_check_reward_errors_stops_above_the_allowed_fraction() -> None:
    cfg = Config(reward=RewardConfig(fn="tiny", max_error_frac=0.5))
    # 2 of 4 failed: at the limit, not above it.
    check_reward_errors(reward_settings(cfg), RewardResult(torch.zeros(4), 1, 1), step=1, device=CPU)
    with pytest.raises(RuntimeError, match=r"step 2: 3 of 4 samples \(75%\).*reward.fn=tiny \(1 timed out"):
        check_reward_errors(reward_settings(cfg), RewardResult(torch.zeros(4), 2, 1), step=2, device=CPU)
    never = Config(reward=RewardConfig(max_error_frac=1.0))
    check_reward_errors(reward_settings(never), RewardResult(torch.zeros(4), 4, 0), step=3, device=CPU)


# ---------------------------------------------------------------------------------------------- over 2 ranks


def _two_rank_worker(rank: int, world: int) -> dict:
    out: dict = {}
    # Overlong: rank 0's responses run into the buffer, rank 1's do not.
    shaping = OverlongShaping(
        _shaping_cfg().reward.overlong_buffer, _shaping_cfg().data.max_response_length, CPU
    )
    shaping(_samples(["x"], raw=[1, 1], lengths=[8, 10] if rank == 0 else [2, 2]))
    out["overlong"] = shaping.metrics()

    # Dynamic sampling: 2 prompts per rank. Rank 0 keeps both of its first batch, rank 1 one: every rank
    # generates again (the fewest kept decides). Then rank 1 has 2, and every rank trains.
    dyn = DynamicSampling(
        _dynamic_cfg().algorithm.filter_groups, _dynamic_cfg().rollout.n, step=1, device=CPU
    )
    dyn.add(_samples(["a", "b"], raw=[1, 0, 1, 0] if rank == 0 else [1, 0, 1, 1]))
    out["enough_1"] = dyn.enough()
    dyn.add(_samples(["c", "d"], raw=[1, 0, 0, 1] if rank == 0 else [0, 0, 0, 1]))
    out["enough_2"] = dyn.enough()
    out["kept"] = [p.ground_truth for p in dyn.kept().prompts]
    out["dynamic"] = dyn.metrics()

    # Reward errors: all of rank 0's samples failed, none of rank 1's; half of the step's.
    bad = RewardResult(torch.zeros(4), 4 if rank == 0 else 0, 0)
    check_reward_errors(Config(reward=RewardConfig(max_error_frac=0.5)), bad, step=1, device=CPU)
    try:
        check_reward_errors(Config(reward=RewardConfig(max_error_frac=0.4)), bad, step=2, device=CPU)
        out["stopped"] = None
    except RuntimeError as e:
        out["stopped"] = str(e)
    return out


def test_decisions_and_metrics_are_the_whole_worlds() -> None:
    results = run_distributed(_two_rank_worker, 2, timeout_s=120)
    for rank, r in enumerate(results):
        # 4 penalties: -0.25, -0.5 (rank 0), 0, 0 (rank 1).
        assert r["overlong"] == pytest.approx(
            {"reward/overlong_penalty_mean": -0.75 / 4, "reward/overlong_frac": 0.5}
        ), rank
        assert r["enough_1"] is False and r["enough_2"] is True, rank
        # Batches per rank; groups kept and dropped over both ranks (rank 1 dropped b and c).
        assert r["dynamic"] == pytest.approx(
            {
                "rollout/num_gen_batches": 2.0,
                "rollout/num_kept_groups": 6.0,
                "rollout/num_dropped_groups": 2.0,
                "rollout/kept_group_fraction": 6 / 8,
            }
        ), rank
        # Both ranks stop, the one whose own samples all scored too.
        assert r["stopped"] is not None and "step 2: 4 of 8 samples (50%)" in r["stopped"], rank
    assert results[0]["kept"] == ["gt-a", "gt-b"] and results[1]["kept"] == ["gt-a", "gt-d"]


def _rollout_group_worker(rank: int, world: int) -> dict | None:
    """Rank 0 is a trainer rank (parallel.placement=async): it never joins; ranks 1-2 generate and decide
    among themselves, as ranks 0-1 of the whole world do above."""
    group = dist.new_group([1, 2])  # every rank creates it, as the placement's meshes are
    if rank == 0:
        return None
    mine = rank - 1
    dyn = DynamicSampling(
        _dynamic_cfg().algorithm.filter_groups, _dynamic_cfg().rollout.n, step=1, device=CPU, group=group
    )
    dyn.add(_samples(["a", "b"], raw=[1, 0, 1, 0] if mine == 0 else [1, 0, 1, 1]))
    first = dyn.enough()
    dyn.add(_samples(["c", "d"], raw=[1, 0, 0, 1] if mine == 0 else [0, 0, 0, 1]))
    return {
        "enough": (first, dyn.enough()),
        "kept": [p.ground_truth for p in dyn.kept().prompts],
        "m": dyn.metrics(),
    }


def test_dynamic_sampling_decides_over_its_group_only() -> None:
    results = run_distributed(_rollout_group_worker, 3, timeout_s=120)
    assert results[0] is None
    for r in results[1:]:
        assert r["enough"] == (False, True)
        assert r["m"] == pytest.approx(
            {
                "rollout/num_gen_batches": 2.0,  # per rank of the group: the 2 ranks', not the 3 of the world
                "rollout/num_kept_groups": 6.0,
                "rollout/num_dropped_groups": 2.0,
                "rollout/kept_group_fraction": 6 / 8,
            }
        )
        assert tuple(r["m"]) == DynamicSampling.METRIC_KEYS  # what travels to the trainer ranks
    assert results[1]["kept"] == ["gt-a", "gt-b"] and results[2]["kept"] == ["gt-a", "gt-d"]
