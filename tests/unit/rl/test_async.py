"""parallel.placement=async's pure parts: policy versions and ages, the staleness guard, the rollout
schedule, the placement and its row layouts, a batch's rows packed and rebuilt, and the config errors."""

from __future__ import annotations

import pytest
import torch

from spmdrl.config import ConfigError, ParallelConfig
from spmdrl.config_loader import load_config
from spmdrl.data.prompts import PromptExample
from spmdrl.distributed.placement import Placement, plan_placement
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.async_rows import BatchLayout, check_async_batch, pack_samples, unpack
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rl.staleness import (
    batch_ahead,
    batch_is_stale,
    drop_stale,
    generation_version,
    policy_ages,
    prefill_batches,
    stale_rows,
    staleness_metrics,
)
from spmdrl.rollout.engine import Generation
from spmdrl.testing.rows import IdsTokenizer, PromptsByIndex


# ------------------------------------------------------------------------------ versions and the schedule
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_schedule_generates_each_batch_once_by_its_version(k: int) -> None:
    """Simulate the rollout ranks' loop (recipes/grpo_async.py): every batch 1..total is generated exactly
    once, in order, by generation_version's version, and trained at an age of at most k."""
    start, total = 0, 7
    version, generated = start, []
    for b in prefill_batches(start, k, total):
        generated.append((b, version))
    for step in range(start + 1, total + 1):
        if k == 0:
            generated.append((step, version))
        ahead = batch_ahead(step, k, total)
        if ahead is not None:
            generated.append((ahead, version))
        version = step  # the sync after update `step`
    assert [b for b, _ in generated] == list(range(1, total + 1))
    for b, v in generated:
        assert v == generation_version(b, k, start)
        age = int(policy_ages(b, torch.tensor([v]))[0])
        assert age == min(k, b - 1 - start)
        assert 0 <= age <= k


def test_versions_after_resume_start_at_the_checkpoint() -> None:
    assert generation_version(11, 2, start=10) == 10  # the pipeline refills from the checkpoint's weights
    assert generation_version(14, 2, start=10) == 11
    assert prefill_batches(10, 2, total=20) == [11, 12]
    assert prefill_batches(10, 2, total=11) == [11]  # never past the last step
    assert batch_ahead(19, 2, total=20) is None and batch_ahead(18, 2, total=20) == 20
    with pytest.raises(ValueError):
        generation_version(10, 1, start=10)


def test_guard_drops_rows_older_than_k() -> None:
    versions_B = torch.tensor([4, 3, 2, 1, 5])
    ages_B = policy_ages(5, versions_B)  # update 5 starts from version 4
    assert ages_B.tolist() == [0, 1, 2, 3, -1]
    stale_B = stale_rows(ages_B, k=2)
    assert stale_B.tolist() == [False, False, False, True, True]  # too old, and from the future
    mask_BT = torch.ones(5, 3, dtype=torch.bool)
    kept = drop_stale(mask_BT, stale_B)
    assert kept.sum(dim=1).tolist() == [3, 3, 3, 0, 0]
    assert mask_BT.all()  # a new mask, the input untouched


def test_staleness_metrics_single_process() -> None:
    ages_B = torch.tensor([0, 1, 1, 1, 3])
    regenerated_B = torch.tensor([True, True, False, False, False])
    m = staleness_metrics(ages_B, stale_rows(ages_B, 1), regenerated_B, 1, torch.device("cpu"), None)
    assert m["async/policy_age_mean"] == pytest.approx(6 / 5)
    assert m["async/policy_age_max"] == 3
    assert m["async/policy_age_frac_0"] == pytest.approx(0.2)
    assert m["async/policy_age_frac_1"] == pytest.approx(0.6)
    assert m["async/dropped_frac"] == pytest.approx(0.2)
    assert m["async/staleness_k"] == 1
    assert m["async/regenerated_frac"] == pytest.approx(0.4)
    assert "async/policy_age_frac_2" not in m


def test_a_batch_is_stale_when_any_response_token_is() -> None:
    # Update 5 starts from version 4. The prompt's positions (mask 0) never count.
    mask_BT = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    assert not batch_is_stale(5, torch.tensor([[0, 3, 3], [0, 4, 0]]), mask_BT, k=1)
    assert batch_is_stale(5, torch.tensor([[0, 3, 2], [0, 4, 0]]), mask_BT, k=1)  # one token of age 2
    assert not batch_is_stale(5, torch.tensor([[0, 3, 2], [0, 4, 0]]), mask_BT, k=2)
    assert batch_is_stale(5, torch.tensor([[4, 4, 4], [4, 5, 4]]), mask_BT, k=1)  # from the future


def test_stale_policy_regenerate_loads_with_async_only() -> None:
    assert _async_cfg("trainer.stale_policy=regenerate").trainer.stale_policy == "regenerate"
    with pytest.raises(
        ConfigError, match="trainer.stale_policy=regenerate applies to parallel.placement=async"
    ):
        load_config(["recipe=grpo_tiny", "trainer.stale_policy=regenerate"])


# ------------------------------------------------------------------------------------ placement, layouts
def test_async_placement_and_layouts() -> None:
    p = plan_placement(ParallelConfig(placement="async"), 4, needs_critic=False, asynchronous=True)
    assert p.is_async and p.role("actor").ranks == [0, 1] and p.role("rollout").ranks == [2, 3]
    assert p.fanout_ranks() == [0, 2, 3]
    assert "rollout: ranks 2-3" in p.describe()
    p = plan_placement(
        ParallelConfig(placement="async", rollout_ranks=1), 3, needs_critic=False, asynchronous=True
    )
    assert p.role("actor").ranks == [0, 1] and p.role("rollout").ranks == [2]
    # As many trainer as rollout ranks: trainer rank j gets rollout rank j's rows, in order.
    lay = BatchLayout.plan(Placement.asynchronous(4, 2), rows_per_rollout_rank=6)
    assert lay.rollout.owner_N.tolist() == [2] * 6 + [3] * 6
    assert lay.trainer.owner_N.tolist() == [0] * 6 + [1] * 6
    # 1 rollout rank feeding 2 trainer ranks: the first half of its rows to rank 0, the rest to rank 1.
    lay = BatchLayout.plan(Placement.asynchronous(3, 1), rows_per_rollout_rank=8)
    assert lay.rollout.rows_of(2).tolist() == list(range(8))
    assert lay.trainer.rows_of(0).tolist() == list(range(4))
    assert lay.trainer.rows_of(1).tolist() == list(range(4, 8))


@pytest.mark.parametrize(
    ("parallel", "world", "asynchronous", "match"),
    [
        (ParallelConfig(placement="async"), 4, False, "entry: grpo_async"),
        (ParallelConfig(placement="colocated"), 4, True, "runs only parallel.placement=async"),
        (ParallelConfig(placement="split"), 4, True, "runs only parallel.placement=async"),
        (ParallelConfig(placement="async"), 1, True, "at least 2 ranks"),
        (ParallelConfig(placement="async", rollout_ranks=4), 4, True, "pick 1..3"),
    ],
)
def test_placement_errors(parallel: ParallelConfig, world: int, asynchronous: bool, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_placement(parallel, world, needs_critic=False, asynchronous=asynchronous)


def test_ppo_refuses_async() -> None:
    with pytest.raises(ConfigError, match="entry: grpo_async"):
        plan_placement(ParallelConfig(placement="async"), 4, needs_critic=True)


def _async_cfg(*overrides: str):  # noqa: ANN202 - a Config
    return load_config(["recipe=grpo_async_tiny", *overrides])


def test_batch_must_be_whole_groups_on_both_sides() -> None:
    check_async_batch(_async_cfg(), Placement.asynchronous(4, 2))
    with pytest.raises(ConfigError, match="whole prompt groups over the 3 rollout ranks"):
        check_async_batch(_async_cfg(), Placement.asynchronous(5, 3))  # 32 prompts over 3
    with pytest.raises(ConfigError, match="rollout.tp=2 must divide the 3 rollout ranks"):
        check_async_batch(
            _async_cfg("trainer.global_batch_size=12", "rollout.tp=2"), Placement.asynchronous(5, 3)
        )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["parallel.placement=colocated", "trainer.max_staleness=0"], "runs only parallel.placement=async"),
        (["parallel.placement=split"], "applies to parallel.placement=async only"),
        (["algorithm.adv_estimator=gae"], "needs a critic"),
        (["trainer.max_staleness=-1"], "must be >= 0"),
        (["parallel.rollout_ranks=-1"], "must be >= 0"),
    ],
)
def test_config_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _async_cfg(*overrides)


def test_staleness_needs_the_async_placement() -> None:
    with pytest.raises(ConfigError, match="applies to parallel.placement=async only"):
        load_config(["recipe=grpo_tiny", "trainer.max_staleness=1"])


@pytest.mark.parametrize(
    "overrides",
    [
        ("reward.overlong_buffer.enable=true",),
        ("algorithm.filter_groups.enable=true",),
        ("algorithm.filter_groups.enable=true", "trainer.max_staleness=1", "rollout.partial=continue"),
        ("algorithm.adv_estimator=remax",),
        ("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format,accuracy]"),
        ("parallel.balance_tokens=true",),
    ],
)
def test_the_colocated_recipes_algorithms_run_async(overrides: tuple[str, ...]) -> None:
    cfg = _async_cfg(*overrides)
    assert cfg.parallel.placement == "async"


def test_k0_may_save_in_the_middle() -> None:
    cfg = _async_cfg("trainer.max_staleness=0", "trainer.save_every=5")
    assert cfg.trainer.save_every == 5 and cfg.parallel.placement == "async"


def test_grpo_refuses_async_at_placement() -> None:
    cfg = load_config(["recipe=grpo_tiny", "parallel.placement=async"])  # refused by build_job's placement
    with pytest.raises(ConfigError, match="entry: grpo_async"):
        plan_placement(cfg.parallel, 4, needs_critic=False)


# ----------------------------------------------------------------------------------------- rows and back
def test_rows_rebuild_the_colocated_views() -> None:
    """pack_samples -> (the wire's width, 0-padded) -> unpack gives back the tokens, logprobs, rewards,
    versions and counts; the PolicyBatch is the one a colocated rank builds, pad ids included."""
    pad, n = 0 + 7, 2
    prompts = [
        PromptExample(11, [1, 2, 3], [], "a", "src", {}),
        PromptExample(5, [4, 5], [], "b", "src", {}),
    ]
    gens = [
        Generation(0, [20, 21], [-0.5, -0.25], "stop"),
        Generation(0, [22, 23, 24, 25], [-1.0, -2.0, -3.0, -4.0], "length"),
        Generation(1, [26], [-0.125], "stop"),
        Generation(1, [27, 28, 29], [-0.5, -0.5, -0.5], "stop"),
    ]
    scores_B = torch.tensor([1.0, 0.0, -0.5, 1.0])
    rewards = RewardResult(
        scores_B,
        2 + 1,
        1,
        num_judge_errors=3,
        num_judge_only=1,
        num_rm_nonfinite=2,
        num_rm_only=1,
        num_env_errors=1,
    )
    samples = ScoredSamples(prompts, gens, rewards, ["x"] * 4, scores_B)
    rows = pack_samples(samples, 3, {"rollout_s": 1.5, "reward_s": 0.25}, pad, torch.device("cpu"))
    width = 16  # a wire that pads every field (move_rows with a fixed width) changes nothing
    wire = {k: torch.nn.functional.pad(v, (0, width - v.shape[1])) for k, v in rows.items()}
    got = unpack(wire, PromptsByIndex(prompts), IdsTokenizer(), n, pad)  # type: ignore[arg-type]
    from spmdrl.rl.experience import policy_batch

    want = policy_batch(samples, pad, torch.device("cpu"))
    for name, t in want.tensors().items():
        assert torch.equal(getattr(got.batch, name), t), name
    assert [g.token_ids for g in got.samples.gens] == [g.token_ids for g in gens]
    assert [g.logprobs for g in got.samples.gens] == [g.logprobs for g in gens]
    assert [g.finish_reason for g in got.samples.gens] == [g.finish_reason for g in gens]
    assert [g.prompt_index for g in got.samples.gens] == [0, 0, 1, 1]
    assert [p.index for p in got.samples.prompts] == [11, 5]
    assert torch.equal(got.samples.scores_B, scores_B)
    assert (got.samples.rewards.num_errors, got.samples.rewards.num_timeouts) == (3, 1)
    # The judge's, the reward model's and the environment's shares travel too, so the trainer's stop names
    # them (spmdrl/rl/samples.py).
    got_r = got.samples.rewards
    counts = (got_r.num_judge_errors, got_r.num_judge_only, got_r.num_rm_nonfinite, got_r.num_rm_only)
    assert counts == (3, 1, 2, 1) and got_r.num_fn_failed == 2 and got_r.num_env_errors == 1
    assert got.versions_B.tolist() == [3, 3, 3, 3]
    assert got.seconds == {"rollout_s": 1.5, "reward_s": 0.25} and got.memory_gb > 0
    assert got.samples.responses == ["20 21", "22 23 24 25", "26", "27 28 29"]
