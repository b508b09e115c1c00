"""Rollout TP groups (spmdrl/rollout/groups.py): scattering a TP group's results, tp must divide the world."""

from __future__ import annotations

import pytest

from spmdrl.rollout.groups import Gathered, TPGroups


def test_scatter_from_tp_keeps_this_ranks_slice() -> None:
    gathered = Gathered(prompts=[[1], [2], [3], [4], [5]], start=2, stop=4)  # rank holds prompts 2 and 3
    results = [f"p{i}s{j}" for i in range(5) for j in range(2)]
    assert TPGroups.scatter_from_tp(results, gathered, per_prompt=2) == ["p2s0", "p2s1", "p3s0", "p3s1"]
    with pytest.raises(ValueError, match="results for 5 prompts"):
        TPGroups.scatter_from_tp(results[:-1], gathered, per_prompt=2)


def test_tp_must_divide_world() -> None:
    from spmdrl.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.tp=3 must be >= 1 and divide the world size"):
        TPGroups(3)
