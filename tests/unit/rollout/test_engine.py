"""Sampling settings of the engine interface (spmdrl/rollout/engine.py): bad values, from the config."""

from __future__ import annotations

import pytest

from spmdrl.rollout.engine import SamplingSpec


def test_sampling_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="identical samples"):
        SamplingSpec(n=4, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingSpec(top_k=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingSpec(max_tokens=0)


def test_sampling_spec_from_config() -> None:
    from spmdrl.config import RolloutConfig

    cfg = RolloutConfig(n=4, temperature=0.7, top_p=0.9, stop=["</answer>"], val_temperature=0.0)
    train = SamplingSpec.for_training(cfg, max_tokens=32, seed=5)
    assert (train.n, train.temperature, train.top_p, train.stop, train.seed) == (
        4,
        0.7,
        0.9,
        ["</answer>"],
        5,
    )
    val = SamplingSpec.for_validation(cfg, max_tokens=32)
    assert (val.n, val.temperature) == (1, 0.0)
