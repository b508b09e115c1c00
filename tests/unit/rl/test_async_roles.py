"""Reward models, multi-turn rollouts, DAPO, ReMax and gdpo under parallel.placement=async, the parts
that need no process group: where reward_model.placement may be what (config load); what the rollout
ranks send besides the tokens, back to a trainer rank's samples: their reduced metrics (CARRIED_METRICS),
ReMax's baselines and the reward function's extra keys (gdpo's components).
The runs themselves: tests/integration/test_grpo_async_reward_model.py, test_grpo_async_multi_turn.py and
test_grpo_async.py."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.config_loader import load_config
from spmdrl.data.prompts import PromptExample
from spmdrl.errors import ConfigError
from spmdrl.logging.timer import PhaseTimer
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.async_rows import (
    CARRIED_METRICS,
    REWARD_EXTRA,
    REWARD_EXTRA_NAMES,
    fill_missing_fields,
    pack_samples,
    unpack,
)
from spmdrl.rl.experience import gdpo_reward_components
from spmdrl.rl.model_rewards import ModelRewards
from spmdrl.rl.samples import DynamicSampling, OverlongShaping, ScoredSamples
from spmdrl.rollout.engine import Generation
from spmdrl.rollout.rollout import MULTI_TURN_KEYS
from spmdrl.testing.rows import IdsTokenizer, PromptsByIndex

RM = ("reward_model.enable=true", "reward_model.path=/some/rm")


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("grpo_tiny", (*RM, "reward_model.placement=separate")),
        ("grpo_tiny", ("reward_model.judge.enable=true", "reward_model.placement=separate")),
        ("ppo_tiny", (*RM, "reward_model.placement=separate", "parallel.placement=split")),
    ],
)
def test_separate_outside_async_is_refused(recipe: str, overrides: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([f"recipe={recipe}", *overrides])
    msg = str(e.value)
    assert "reward_model.placement=separate" in msg and "rollout ranks of parallel.placement=async" in msg
    assert "recipe=grpo_async_tiny" in msg and "reward_model.placement=colocated" in msg  # the two fixes


def test_reward_models_under_split_are_refused() -> None:
    with pytest.raises(ConfigError, match="need parallel.placement=colocated .* or async"):
        load_config(["recipe=ppo_tiny", *RM, "parallel.placement=split"])


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_async_takes_reward_models_on_either_setting(placement: str) -> None:
    """Under async the reward model is always on the rollout ranks: colocated is the same as separate."""
    cfg = load_config(
        [
            "recipe=grpo_async_tiny",
            *RM,
            f"reward_model.placement={placement}",
            "reward_model.judge.enable=true",
        ]
    )
    assert cfg.reward_model.enable and cfg.parallel.placement == "async"


def test_async_takes_multi_turn() -> None:
    cfg = load_config(
        ["recipe=grpo_async_tiny", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"]
    )
    assert cfg.rollout.multi_turn.enable


def test_carried_metrics_cover_what_the_rollout_ranks_measure() -> None:
    measured = {
        *ModelRewards.METRIC_KEYS,
        *OverlongShaping.METRIC_KEYS,
        *MULTI_TURN_KEYS,
        *DynamicSampling.METRIC_KEYS,
    }
    assert measured == set(CARRIED_METRICS)
    assert len(CARRIED_METRICS) == len(set(CARRIED_METRICS))


def _samples() -> ScoredSamples:
    prompts = [PromptExample(3, [1, 2], [], "a", "src", {})]
    gens = [Generation(0, [20, 21], [-0.5, -0.25], "stop"), Generation(0, [22], [-1.0], "stop")]
    scores_B = torch.tensor([2.5, -1.0])
    return ScoredSamples(prompts, gens, RewardResult(scores_B, 0, 0), ["x", "y"], scores_B)


def test_measured_metrics_travel_with_the_rows() -> None:
    """What the rollout ranks reduced reaches the trainer rank's samples.metrics (which step_metrics puts
    in the logged row); what was not measured stays absent rather than 0."""
    measured = {"reward/rm_score": 1.25, "reward/rule_score": 0.5, "multi_turn/tool_calls": 2.0}
    rows = pack_samples(_samples(), 0, {}, 0, torch.device("cpu"), measured=measured)
    assert rows["measured"].shape == (2, len(CARRIED_METRICS))
    wire = {k: torch.nn.functional.pad(v, (0, 40 - v.shape[1])) for k, v in rows.items()}
    got = unpack(wire, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    assert got.samples.metrics == measured
    assert got.samples.metrics is not None and not any(math.isnan(v) for v in got.samples.metrics.values())
    nothing = pack_samples(_samples(), 0, {}, 0, torch.device("cpu"))
    wire = {k: torch.nn.functional.pad(v, (0, 40 - v.shape[1])) for k, v in nothing.items()}
    assert unpack(wire, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0).samples.metrics == {}  # type: ignore[arg-type]


def test_an_unlisted_metric_is_refused_not_dropped() -> None:
    with pytest.raises(ValueError, match="add them to CARRIED_METRICS"):
        pack_samples(_samples(), 0, {}, 0, torch.device("cpu"), measured={"reward/new_thing": 1.0})


# ------------------------------------------------------------------------------ ReMax and the reward's keys
def _two_rank_wire(*packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a trainer rank receives from several rollout ranks (move_rows, width=None): each field as wide
    as its widest sender's, a narrower sender's rows padded with 0."""
    out = {}
    for name in packed[0]:
        w = max(p[name].shape[1] for p in packed)
        out[name] = torch.cat([torch.nn.functional.pad(p[name], (0, w - p[name].shape[1])) for p in packed])
    return out


def _samples_with_extra(extra: dict[str, list[float]], index: int) -> ScoredSamples:
    s = _samples()
    prompts = [PromptExample(index, [1, 2], [], "a", "src", {})]
    rewards = RewardResult(s.scores_B, 0, 0, extra)
    return ScoredSamples(prompts, s.gens, rewards, s.responses, s.scores_B)


def test_reward_extra_keys_travel_per_row() -> None:
    """Two rollout ranks whose reward functions returned different keys (one sample of the first without
    ``format``): the trainer rank's RewardResult.extra is what one colocated rank would hold for those
    rows, NaN where a row has no value, and gdpo reads its components from it."""
    cpu = torch.device("cpu")
    a = pack_samples(
        _samples_with_extra({"format": [1.0, math.nan], "accuracy": [0.0, 1.0]}, 3), 0, {}, 0, cpu
    )
    b = pack_samples(_samples_with_extra({"accuracy": [1.0, 1.0]}, 4), 0, {}, 0, cpu)
    assert a[REWARD_EXTRA].shape == (2, 2) and b[REWARD_EXTRA].shape == (2, 1)
    prompts = PromptsByIndex(
        [PromptExample(3, [1, 2], [], "a", "src", {}), PromptExample(4, [1, 2], [], "a", "src", {})]
    )
    got = unpack(_two_rank_wire(a, b), prompts, IdsTokenizer(), 2, 0).samples.rewards  # type: ignore[arg-type]
    assert sorted(got.extra) == ["accuracy", "format"]
    assert got.extra["accuracy"] == [0.0, 1.0, 1.0, 1.0]
    fmt = got.extra["format"]
    assert fmt[0] == 1.0 and all(math.isnan(v) for v in fmt[1:])
    cfg = load_config(
        [
            "recipe=grpo_async_tiny",
            "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[accuracy,format]",
        ]
    )
    components = gdpo_reward_components(cfg.algorithm, cfg.reward, got)
    assert components is not None
    err = cfg.reward.error_score
    assert components.tolist() == [[0.0, 1.0], [1.0, err], [1.0, err], [1.0, err]]
    # A plain score sends nothing wide; a key with the names' separator in it is refused, not garbled.
    plain = pack_samples(_samples(), 0, {}, 0, cpu)
    assert plain[REWARD_EXTRA].shape == (2, 0) and plain[REWARD_EXTRA_NAMES].shape == (2, 0)
    with pytest.raises(ValueError, match="newline"):
        pack_samples(_samples_with_extra({"a\nb": [1.0, 1.0]}, 3), 0, {}, 0, cpu)


def test_remax_baselines_travel() -> None:
    cpu = torch.device("cpu")
    rows = pack_samples(_samples(), 0, {}, 0, cpu, baseline_B=torch.tensor([0.5, 0.5]))
    wire = {k: torch.nn.functional.pad(v, (0, 40 - v.shape[1])) for k, v in rows.items()}
    got = unpack(wire, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    assert got.baseline_B is not None and got.baseline_B.tolist() == [0.5, 0.5]
    none = pack_samples(_samples(), 0, {}, 0, cpu)
    assert unpack(none, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0).baseline_B is None  # type: ignore[arg-type]


def test_rows_queued_before_baselines_and_extra_keys_travelled() -> None:
    cpu = torch.device("cpu")
    rows = pack_samples(_samples_with_extra({"acc": [1.0, 0.0]}, 3), 5, {}, 0, cpu)
    for name in ("baseline", REWARD_EXTRA, REWARD_EXTRA_NAMES):
        rows.pop(name)
    filled = fill_missing_fields(rows, 5)
    got = unpack(filled, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    assert got.baseline_B is None and got.samples.rewards.extra == {}


def test_a_rollout_wait_travels_and_a_queue_saved_under_the_old_name_resumes() -> None:
    """What a wrapped Rollout waited (its rollout_wait_s phase) reaches the trainer as rollout/wait_s; rows
    queued when the column was the latency tail's (latency_tail_s) drop it and report no wait."""
    cpu = torch.device("cpu")
    rows = pack_samples(_samples(), 5, {"rollout_s": 3.0, "rollout_wait_s": 2.0}, 0, cpu)
    got = unpack(rows, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    assert got.seconds == {"rollout_s": 3.0, "reward_s": 0.0, "rollout_wait_s": 2.0}
    assert got.timings(PhaseTimer()) == {"rollout/wait_s": 2.0}
    rows["latency_tail_s"] = rows.pop("rollout_wait_s")
    filled = fill_missing_fields(rows, 5)
    assert "latency_tail_s" not in filled
    got = unpack(filled, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    assert "rollout_wait_s" not in got.seconds and got.timings(PhaseTimer()) == {}


def _measured_after_restore(
    names: tuple[str, ...] | None, values: list[float], width: int
) -> dict[str, float]:
    """Rows queued with ``width`` measured columns (``values`` first, NaN after), restored as a resumed run
    restores them (``names``: those the queue was saved with), as a trainer rank reads them."""
    cpu = torch.device("cpu")
    rows = pack_samples(_samples(), 0, {}, 0, cpu)
    rows["measured"] = torch.tensor(values + [math.nan] * (width - len(values)), dtype=torch.float64).expand(
        2, -1
    )
    filled = fill_missing_fields(rows, 0, names)
    return unpack(filled, PromptsByIndex(_samples().prompts), IdsTokenizer(), 2, 0).samples.metrics  # type: ignore[arg-type]


def test_queued_metrics_are_read_by_name() -> None:
    """A queue saved by another release, whose measured columns were in another order, resumes with each
    value under its own name: by the names it was saved with, or, saved without them, by their count."""
    # Queues saved without names predate multi_turn/observation_images (MULTI_TURN_KEYS' last).
    rm, mt = len(ModelRewards.METRIC_KEYS), len(MULTI_TURN_KEYS) - 1
    # Saved before the overlong penalty travelled: the reward model's columns, then multi-turn's.
    legacy = [0.0] * (rm + mt)
    legacy[rm] = 3.0  # the first multi-turn metric
    got = _measured_after_restore(None, legacy, rm + mt)
    assert got[MULTI_TURN_KEYS[0]] == 3.0 and not any(k.startswith("reward/overlong") for k in got)
    # Saved with the overlong penalty's columns (the current list's first ones): as they are.
    ov = [math.nan] * rm + [-0.5, 0.25] + [7.0] * mt
    got = _measured_after_restore(None, ov, rm + 2 + mt)
    assert got["reward/overlong_penalty_mean"] == -0.5 and got[MULTI_TURN_KEYS[-2]] == 7.0
    assert "multi_turn/observation_images" not in got  # not measured then: nothing to log
    # Saved with its names, in another order, one no longer carried: by name.
    got = _measured_after_restore(
        ("reward/overlong_frac", "gone/metric", "rollout/num_gen_batches"), [0.5, 9.0, 2.0], 3
    )
    assert got == {"reward/overlong_frac": 0.5, "rollout/num_gen_batches": 2.0}
    # Saved without names, in a layout no release wrote: nothing to name, nothing misnamed.
    assert _measured_after_restore(None, [1.0, 2.0, 3.0], 3) == {}
