"""rollout.partial's pure parts: per-token versions through the rows, token ages, the per-token guard and
its metrics, and the config errors."""

from __future__ import annotations

import pytest
import torch

from spmdrl.config_loader import load_config
from spmdrl.data.prompts import PromptExample
from spmdrl.errors import ConfigError
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.async_rows import TOKEN_VERSIONS, fill_missing_fields, pack_samples, unpack
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rl.staleness import drop_stale_tokens, token_ages, token_staleness_metrics
from spmdrl.rollout.engine import Generation
from spmdrl.testing.rows import IdsTokenizer, PromptsByIndex


def _samples() -> ScoredSamples:
    prompts = [PromptExample(11, [1, 2, 3], [], "a", "src", {}), PromptExample(5, [4, 5], [], "b", "src", {})]
    gens = [
        Generation(0, [20, 21], [-0.5, -0.25], "stop"),
        Generation(0, [22, 23, 24, 25], [-1.0, -2.0, -3.0, -4.0], "length"),
        Generation(1, [26], [-0.125], "stop"),
        Generation(1, [27, 28, 29], [-0.5, -0.5, -0.5], "stop"),
    ]
    scores_B = torch.tensor([1.0, 0.0, -0.5, 1.0])
    return ScoredSamples(prompts, gens, RewardResult(scores_B, 0, 0), ["x"] * 4, scores_B)


def _wire(rows: dict[str, torch.Tensor], width: int = 16) -> dict[str, torch.Tensor]:
    return {k: torch.nn.functional.pad(v, (0, width - v.shape[1])) for k, v in rows.items()}


def test_token_versions_travel_with_the_rows() -> None:
    samples = _samples()
    versions = [[3, 3], [3, 4, 4, 4], [3], [4, 4, 4]]
    interrupted = [False, True, False, True]
    rows = pack_samples(
        samples, 3, {}, 0, torch.device("cpu"), token_versions=versions, interrupted=interrupted
    )
    got = unpack(_wire(rows), PromptsByIndex(samples.prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    assert got.versions_B.tolist() == [3, 3, 3, 3]  # the row's version: the one that started it
    assert got.interrupted_B is not None and got.interrupted_B.tolist() == interrupted
    assert got.versions_BT is not None
    mask = got.batch.response_mask_BT
    for i, v in enumerate(versions):
        assert got.versions_BT[i][mask[i]].tolist() == v
    # Without partial rollouts every token is the row's version and nothing was interrupted.
    plain = unpack(
        _wire(pack_samples(samples, 7, {}, 0, torch.device("cpu"))),
        PromptsByIndex(samples.prompts),
        IdsTokenizer(),
        2,
        0,
    )  # type: ignore[arg-type]
    assert plain.versions_BT is not None and plain.interrupted_B is not None
    assert bool((plain.versions_BT[plain.batch.response_mask_BT] == 7).all())
    assert not bool(plain.interrupted_B.any())


def test_rows_queued_by_an_earlier_release_get_the_new_fields() -> None:
    samples = _samples()
    rows = pack_samples(samples, 5, {}, 0, torch.device("cpu"))
    want_versions, want_interrupted = rows.pop(TOKEN_VERSIONS), rows.pop("interrupted")
    filled = fill_missing_fields(rows, 5)
    assert torch.equal(filled[TOKEN_VERSIONS], want_versions)
    assert torch.equal(filled["interrupted"], want_interrupted)


def test_token_guard_and_metrics() -> None:
    # Update 5 starts from version 4; k = 1. Row 0: one token of version 2 (age 2: stale), two of 4.
    versions_BT = torch.tensor([[9, 2, 4, 4], [9, 3, 3, 0], [9, 4, 4, 4]])
    mask_BT = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    ages_BT = token_ages(5, versions_BT)
    kept = drop_stale_tokens(mask_BT, ages_BT, k=1)
    assert kept.tolist() == [
        [False, False, True, True],
        [False, True, True, False],
        [False, True, True, True],
    ]
    m = token_staleness_metrics(
        ages_BT,
        mask_BT,
        torch.tensor([True, False, False]),
        torch.tensor([False, False, True]),
        1,
        torch.device("cpu"),
        None,
    )
    # 8 response tokens: ages 2, 0, 0 | 1, 1 | 0, 0, 0
    assert m["async/policy_age_mean"] == pytest.approx(4 / 8)
    assert m["async/policy_age_max"] == 2.0
    assert m["async/dropped_frac"] == pytest.approx(1 / 8)
    assert m["async/policy_age_frac_0"] == pytest.approx(5 / 8)
    assert m["async/policy_age_frac_1"] == pytest.approx(2 / 8)
    assert m["async/partial_frac"] == pytest.approx(1 / 3)
    assert m["async/regenerated_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["recipe=grpo_async_tiny", "trainer.max_staleness=0", "rollout.partial=continue"],
            "max_staleness >= 1",
        ),
        (["recipe=grpo_tiny", "rollout.partial=abort"], "parallel.placement=async"),
        (["recipe=grpo_async_tiny", "rollout.partial=sometimes"], "is not one of off, continue, abort"),
    ],
)
def test_partial_config_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def test_partial_config_accepted_with_staleness() -> None:
    cfg = load_config(["recipe=grpo_async_tiny", "trainer.max_staleness=1", "rollout.partial=continue"])
    assert cfg.rollout.partial == "continue"
