"""Placement planning: wrong rank sets are rejected with the fix named, before any model is built."""

from __future__ import annotations

import pytest

from spmdrl.config import ConfigError, ParallelConfig
from spmdrl.distributed.placement import Placement, RoleSpec, plan_placement


def test_colocated_puts_every_role_on_every_rank() -> None:
    p = plan_placement(ParallelConfig(), 4, needs_critic=True)
    assert not p.is_split
    assert all(p.role(r).ranks == [0, 1, 2, 3] for r in ("actor", "ref", "critic", "rollout"))
    assert p.fanout_ranks() == []


def test_split_default_is_half_and_half() -> None:
    p = plan_placement(ParallelConfig(placement="split"), 4, needs_critic=True)
    assert p.role("actor").ranks == [0, 1] and p.role("ref").ranks == [0, 1]
    assert p.role("critic").ranks == [2, 3]
    assert p.role("rollout").ranks == [0, 1, 2, 3]
    assert p.fanout_ranks() == [0, 2, 3]
    assert p.describe() == (
        "split: actor: ranks 0-1 (FSDP 2), ref: ranks 0-1 (FSDP 2), critic: ranks 2-3 (FSDP 2); "
        "rollout on all 4 ranks"
    )


def test_split_sizes_and_hsdp() -> None:
    p = plan_placement(
        ParallelConfig(placement="split", critic_ranks=2, dp_replicate=2), 6, needs_critic=True
    )
    assert p.role("actor").ranks == [0, 1, 2, 3] and p.role("critic").ranks == [4, 5]
    assert p.role("actor").dp_shard == 2 and p.role("critic").dp_shard == 1


@pytest.mark.parametrize(
    ("parallel", "world", "needs_critic", "match"),
    [
        (ParallelConfig(placement="split"), 4, False, "trains no critic"),
        (ParallelConfig(placement="split"), 1, True, "at least 2 ranks"),
        (ParallelConfig(placement="split", critic_ranks=4), 4, True, r"critic_ranks=4 must leave .* 1\.\.3"),
        (
            ParallelConfig(placement="split", critic_ranks=1, dp_replicate=2),
            4,
            True,
            "must divide the 3 ranks",
        ),
        (ParallelConfig(dp_replicate=3), 4, True, "must divide the 4 ranks"),
    ],
)
def test_bad_placements_are_rejected(
    parallel: ParallelConfig, world: int, needs_critic: bool, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_placement(parallel, world, needs_critic=needs_critic)


def test_overlapping_roles_are_rejected() -> None:
    with pytest.raises(ConfigError, match="overlap"):
        Placement(4, {"actor": RoleSpec("actor", 0, 3), "critic": RoleSpec("critic", 2, 2)}, kind="split")
    with pytest.raises(ConfigError, match="wants ranks 2..4"):
        Placement(4, {"critic": RoleSpec("critic", 2, 3)}, kind="split")
    with pytest.raises(ConfigError, match="has no ranks"):
        Placement(4, {"critic": RoleSpec("critic", 4, 0)}, kind="split")


def test_expert_parallelism_is_the_actors_alone() -> None:
    p = plan_placement(ParallelConfig(ep=2), 4, needs_critic=False)
    assert p.role("actor").ep == 2 and p.role("ref").ep == 1
    assert "critic" not in p.roles  # a job without a value model lists no critic (GRPO's plan line)
    assert p.describe().startswith(
        "colocated: actor: ranks 0-3 (FSDP 4, experts EP 2 x FSDP 2), ref: ranks 0-3 (FSDP 4)"
    )


@pytest.mark.parametrize(
    ("parallel", "world", "match"),
    [
        (ParallelConfig(ep=3), 4, r"parallel.ep=3 must divide the 4 ranks of role 'actor'.* 1, 2, 4"),
        (ParallelConfig(ep=2, dp_replicate=2), 4, r"dp_replicate=2 \(HSDP\) is not supported"),
        # split: the actor has the ranks the critic leaves it
        (
            ParallelConfig(ep=2, placement="split", critic_ranks=1),
            4,
            r"parallel.ep=2 must divide the 3 ranks of role 'actor'.*choose parallel.critic_ranks \(placement split\)",
        ),
        # async: the trainer ranks (the world less the rollout ranks) are the ones ep must divide
        (
            ParallelConfig(ep=2, placement="async", rollout_ranks=1),
            4,
            r"parallel.ep=2 must divide the 3 ranks of role 'actor'.*parallel.rollout_ranks \(placement async\)",
        ),
        (
            ParallelConfig(ep=2, placement="async", dp_replicate=2, rollout_ranks=2),
            6,
            r"dp_replicate=2 \(HSDP\) is not supported",
        ),
    ],
)
def test_bad_expert_parallelism_is_rejected(parallel: ParallelConfig, world: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_placement(
            parallel,
            world,
            needs_critic=parallel.placement == "split",
            asynchronous=parallel.placement == "async",
        )


@pytest.mark.parametrize(("world", "rollout", "ep"), [(4, 2, 2), (6, 2, 4), (6, 2, 2), (3, 1, 2)])
def test_expert_parallelism_on_the_async_trainer_ranks(world: int, rollout: int, ep: int) -> None:
    """The ep groups tile the trainer ranks 0 .. T-1 only; the engines on the rollout ranks hold no experts of
    their own (they get every expert by the fanout broadcast from rank 0)."""
    p = plan_placement(
        ParallelConfig(placement="async", rollout_ranks=rollout, ep=ep),
        world,
        needs_critic=False,
        asynchronous=True,
    )
    t = world - rollout
    assert p.role("actor").ranks == list(range(t)) and p.role("actor").ep == ep
    assert p.role("ref").ep == 1 and p.role("rollout").ep == 1
    assert p.fanout_ranks() == [0, *range(t, world)]
    last = f"rank {t - 1}" if t == 1 else f"ranks 0-{t - 1}"
    assert f"actor: {last} (FSDP {t}, experts EP {ep} x FSDP {t // ep})" in p.describe()


def test_expert_parallelism_with_the_teacher_on_ranks_of_its_own() -> None:
    p = plan_placement(ParallelConfig(teacher_ranks=2, ep=2), 6, needs_critic=False, teacher=True)
    assert p.role("actor").ranks == [0, 1, 2, 3] and p.role("actor").ep == 2
    assert p.role("ref").ep == 1 and p.role("teacher").ep == 1 and p.role("teacher").ranks == [4, 5]
    assert "actor: ranks 0-3 (FSDP 4, experts EP 2 x FSDP 2)" in p.describe()
    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide the 3 ranks of role 'actor'"):
        plan_placement(ParallelConfig(teacher_ranks=1, ep=2), 4, needs_critic=False, teacher=True)


def test_ep_below_one_is_rejected() -> None:
    with pytest.raises(ConfigError, match="parallel.ep must be >= 1"):
        ParallelConfig(ep=0).check()


def test_the_teacher_goes_on_the_actors_ranks_or_on_ranks_of_its_own():
    both = plan_placement(ParallelConfig(), 4, needs_critic=False, teacher=True)
    assert both.role("teacher").ranks == [0, 1, 2, 3] and not both.teacher_apart
    assert both.fanout_ranks() == []
    assert "teacher" not in plan_placement(ParallelConfig(), 4, needs_critic=False).roles


@pytest.mark.parametrize(("world", "n"), [(4, 1), (4, 2), (4, 3), (6, 2), (2, 1)])
def test_a_teacher_on_ranks_of_its_own_takes_the_last_n_and_the_actor_the_rest(world: int, n: int):
    p = plan_placement(ParallelConfig(teacher_ranks=n), world, needs_critic=False, teacher=True)
    a = world - n
    assert p.teacher_apart and p.kind == "colocated"
    assert p.role("teacher").ranks == list(range(a, world))
    assert p.role("actor").ranks == p.role("ref").ranks == list(range(a))
    # Every rank generates; the teacher's ranks get the actor's weights from the first actor rank.
    assert p.role("rollout").ranks == list(range(world))
    assert p.fanout_ranks() == [0, *range(a, world)]
    assert not set(p.role("actor").ranks) & set(p.role("teacher").ranks)


def test_the_teacher_on_its_own_ranks_is_described():
    p = plan_placement(ParallelConfig(teacher_ranks=1), 4, needs_critic=False, teacher=True)
    assert p.describe() == (
        "colocated: actor: ranks 0-2 (FSDP 3), ref: ranks 0-2 (FSDP 3), "
        "teacher: rank 3 (FSDP 1, no actor); "
        "rollout on all 4 ranks"
    )
    hsdp = plan_placement(
        ParallelConfig(teacher_ranks=2, dp_replicate=2), 6, needs_critic=False, teacher=True
    )
    assert hsdp.role("actor").dp_replicate == 2 and hsdp.role("actor").ranks == [0, 1, 2, 3]
    assert "actor: ranks 0-3 (HSDP 2x2)" in hsdp.describe()


@pytest.mark.parametrize(
    ("parallel", "world", "teacher", "expect"),
    [
        (
            ParallelConfig(teacher_ranks=4),
            4,
            True,
            r"teacher_ranks=4 does not fit the world of 4 ranks.*pick 1..3",
        ),
        (ParallelConfig(teacher_ranks=1), 1, True, r"teacher_ranks=1 does not fit the world of 1 ranks"),
        (
            ParallelConfig(teacher_ranks=2),
            4,
            False,
            r"teacher_ranks=2 places a teacher, but the job has none",
        ),
        (
            ParallelConfig(teacher_ranks=1, dp_replicate=2),
            4,
            True,
            r"parallel.dp_replicate=2 must divide the 3 ranks of role 'actor'",
        ),
        (
            ParallelConfig(teacher_ranks=1, placement="split"),
            4,
            True,
            r"parallel.placement=split already gives ranks to another role.*parallel.teacher_ranks=0",
        ),
    ],
)
def test_teacher_ranks_that_cannot_work_are_refused(
    parallel: ParallelConfig, world: int, teacher: bool, expect: str
):
    with pytest.raises(ConfigError, match=expect):
        plan_placement(parallel, world, needs_critic=parallel.placement == "split", teacher=teacher)


def test_negative_teacher_ranks_are_refused():
    with pytest.raises(ConfigError, match=r"parallel.teacher_ranks must be >= 0"):
        ParallelConfig(teacher_ranks=-1).check()


@pytest.mark.parametrize(("world", "critic", "ep"), [(3, 1, 2), (6, 2, 4), (5, 1, 2)])
def test_expert_parallelism_on_the_split_actor_ranks(world: int, critic: int, ep: int) -> None:
    """parallel.placement=split: the ep groups tile the actor's ranks 0 .. W-C-1; the critic (a dense value
    model: PPO builds none on a mixture of experts) and the reference keep ep 1."""
    p = plan_placement(
        ParallelConfig(placement="split", critic_ranks=critic, ep=ep), world, needs_critic=True
    )
    a = world - critic
    assert p.role("actor").ranks == list(range(a)) and p.role("actor").ep == ep
    assert p.role("critic").ep == 1 and p.role("ref").ep == 1
    assert f"experts EP {ep} x FSDP {a // ep}" in p.describe()


def test_a_job_without_a_critic_lists_none() -> None:
    """GRPO's plan line names the roles that run: no critic unless the job trains a value model."""
    grpo = plan_placement(ParallelConfig(), 2, needs_critic=False)
    assert (
        grpo.describe()
        == "colocated: actor: ranks 0-1 (FSDP 2), ref: ranks 0-1 (FSDP 2); rollout on all 2 ranks"
    )
    ppo = plan_placement(ParallelConfig(), 2, needs_critic=True)
    assert "critic: ranks 0-1 (FSDP 2)" in ppo.describe()
