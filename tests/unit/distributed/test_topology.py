"""Rollout TP groups must stay inside a node: the arithmetic and the env reading, no processes."""

from __future__ import annotations

import pytest

from spmdrl.distributed.placement import rollout_tp_groups
from spmdrl.distributed.topology import check_tp_within_nodes, node_layout_from_env, ranks_on_node
from spmdrl.errors import ConfigError


@pytest.mark.parametrize(
    ("tp", "world", "local"),
    [
        (1, 1, 1),  # a plain single process
        (1, 16, 8),
        (2, 16, 8),
        (4, 16, 8),
        (8, 16, 8),  # one engine per node
        (8, 64, 8),
        (2, 2, 2),  # one node: every group is local
        (3, 12, 6),
        (1, 2, 1),  # two one-process nodes (tests/integration/test_multinode.py)
    ],
)
def test_groups_inside_nodes_pass(tp: int, world: int, local: int) -> None:
    check_tp_within_nodes(tp, world, local)
    # And indeed every group of rollout_tp_groups lies on one node.
    assert all(len({r // local for r in g}) == 1 for g in rollout_tp_groups(world, tp))


@pytest.mark.parametrize(
    ("tp", "world", "local", "span"),
    [
        (4, 12, 6, "ranks 4-7 one vLLM engine, but they are on nodes 0 and 1"),
        (3, 16, 8, "ranks 6-8 one vLLM engine, but they are on nodes 0 and 1"),
        (2, 2, 1, "ranks 0-1 one vLLM engine, but they are on nodes 0 and 1"),
        (16, 16, 8, "ranks 0-15 one vLLM engine, but they are on nodes 0 and 1"),
        (32, 64, 8, "ranks 0-31 one vLLM engine, but they are on nodes 0-3"),
    ],
)
def test_group_across_nodes_is_refused_with_the_fix(tp: int, world: int, local: int, span: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_tp_within_nodes(tp, world, local)
    msg = str(err.value)
    assert span in msg
    assert f"rollout.tp={tp}" in msg and f"LOCAL_WORLD_SIZE={local}" in msg
    assert f"Use a rollout.tp that divides {local}" in msg and "--nproc_per_node" in msg


def test_the_fix_lists_the_tp_values_that_fit() -> None:
    with pytest.raises(ConfigError, match=r"divides 6 \(1, 2, 3, 6\)"):
        check_tp_within_nodes(4, 12, 6)


def test_tp_larger_than_the_world() -> None:
    with pytest.raises(ConfigError, match="rollout.tp=2 is larger than the world of 1 ranks"):
        check_tp_within_nodes(2, 1, 1)


def test_uneven_nodes_are_refused() -> None:
    # 8 + 4 ranks: the 8-rank node sees a world of 12 it cannot be a whole number of.
    with pytest.raises(ConfigError, match="not a multiple of the 8 ranks on this node") as err:
        check_tp_within_nodes(2, 12, 8)
    assert "same number of processes on every node" in str(err.value)


@pytest.mark.parametrize(("tp", "world", "local"), [(0, 8, 8), (2, 0, 8), (2, 8, 0)])
def test_non_positive_sizes_are_refused(tp: int, world: int, local: int) -> None:
    with pytest.raises(ConfigError, match="must all be >= 1"):
        check_tp_within_nodes(tp, world, local)


def test_layout_of_a_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_layout_from_env() == (1, 1)


def test_layout_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert node_layout_from_env() == (16, 8)


def test_layout_without_local_size_is_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_layout_from_env() == (4, 4)


@pytest.mark.parametrize("bad", ["0", "-2", "eight"])
def test_layout_rejects_bad_values(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        node_layout_from_env()


def test_ranks_on_node_counts_the_given_ranks_sharing_this_ranks_node() -> None:
    # Two nodes of 4 ranks; the engines on ranks 2..5 (async placement's rollout ranks, say).
    assert [ranks_on_node(range(2, 6), rank, 4) for rank in (0, 3, 4, 7)] == [2, 2, 2, 2]
    assert ranks_on_node(range(8), 5, 4) == 4
    assert ranks_on_node([6, 7], 1, 4) == 0
