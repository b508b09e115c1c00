"""Node topology: which ranks share a node, and the start-up check that rollout TP groups stay inside one.

torchrun numbers ranks node by node: the agent of each node starts ``LOCAL_WORLD_SIZE`` workers and
gives them consecutive global ranks. A rollout engine is ``rollout.tp`` consecutive ranks
(``placement.rollout_tp_groups``), so whether an engine fits in one node is plain arithmetic on
those two numbers. docs/scaling.md has the sizing rules this belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from spmdrl.errors import ConfigError


def node_layout_from_env() -> tuple[int, int]:
    """``(world_size, local_world_size)`` from torchrun's ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``.

    A plain single process (no torchrun) is a world of one on one node. When only ``WORLD_SIZE`` is
    set, every rank is taken to be on one node: a launcher that does not say otherwise gets no
    cross-node error it cannot act on.
    """
    world = _positive_env("WORLD_SIZE", 1)
    local = _positive_env("LOCAL_WORLD_SIZE", world)
    return world, local


def check_tp_within_nodes(tp: int, world_size: int, local_world_size: int) -> None:
    """Raises ConfigError when a rollout TP group (``tp`` consecutive ranks) would span two nodes.

    The ranks of one engine run an all-reduce in every layer of every forward; across nodes those go
    over the network instead of NVLink, and vLLM's external_launcher sets its groups up expecting
    them on one machine. Each node sees only its own ``local_world_size``, so a mix such as 8 + 4 + 4
    ranks is caught on the node where the arithmetic fails (here: the 8-rank node).
    """
    if tp < 1 or world_size < 1 or local_world_size < 1:
        raise ConfigError(
            f"rollout.tp={tp}, world size {world_size} and ranks per node {local_world_size} must all be >= 1"
        )
    if world_size % local_world_size:
        raise ConfigError(
            f"the world has {world_size} ranks, not a multiple of the {local_world_size} ranks on this node "
            f"(LOCAL_WORLD_SIZE): the nodes run different numbers of ranks, so rollout TP groups of "
            f"consecutive ranks cannot be placed node by node. Start the same number of processes on every "
            f"node (torchrun --nproc_per_node=N on each, N a multiple of rollout.tp={tp})"
        )
    if local_world_size % tp:
        raise ConfigError(_crossing_message(tp, world_size, local_world_size))


def _crossing_message(tp: int, world_size: int, local: int) -> str:
    divisors = ", ".join(str(d) for d in range(1, local + 1) if local % d == 0)
    fix = (
        f"Use a rollout.tp that divides {local} ({divisors}), or start a multiple of {tp} processes per "
        f"node (torchrun --nproc_per_node)"
    )
    if tp > world_size:
        return f"rollout.tp={tp} is larger than the world of {world_size} ranks ({local} per node). {fix}"
    first = _first_crossing_rank(tp, local)
    last = first + tp - 1
    a, b = first // local, min(last, world_size - 1) // local
    nodes = f"nodes {a} and {b}" if b == a + 1 else f"nodes {a}-{b}"
    return (
        f"rollout.tp={tp} makes ranks {first}-{last} one vLLM engine, but they are on {nodes} "
        f"({local} ranks per node: LOCAL_WORLD_SIZE={local}, world size {world_size}). A tensor-parallel "
        f"group must sit inside one node: torchrun numbers ranks node by node, the engine all-reduces in "
        f"every layer, and vLLM's external_launcher expects its TP group on one machine. {fix}"
    )


def _first_crossing_rank(tp: int, local: int) -> int:
    """The first rank of the first TP group whose ranks are not all on one node (local % tp != 0)."""
    first = 0
    while first // local == (first + tp - 1) // local:
        first += tp
    return first


def _positive_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{name}={raw!r} must be a positive integer (torchrun sets it; unset it outside torchrun)"
        )
    return value


def ranks_on_node(ranks: Iterable[int], rank: int, local_world_size: int) -> int:
    """How many of ``ranks`` share ``rank``'s node (torchrun numbers ranks node by node)."""
    node = rank // local_world_size
    return sum(1 for r in ranks if r // local_world_size == node)
