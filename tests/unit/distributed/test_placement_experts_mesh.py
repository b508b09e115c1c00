"""The experts' ("efsdp", "ep") mesh of an actor that holds only some of the ranks (parallel.placement=async,
parallel.teacher_ranks): built on every rank of a real 6-process gloo world, its groups are the actor's ranks
unflattened (ep groups of consecutive ranks, efsdp across them), they carry collectives, and the ranks outside
the actor take part in creating them (else the world's new_group calls would not match and it would hang)."""

from __future__ import annotations

from spmdrl.distributed.placement import Placement, RoleSpec

WORLD = 6


def _groups(placement: Placement) -> dict:
    import torch
    import torch.distributed as dist

    meshes = placement.build_meshes("cpu")
    experts = meshes.experts("actor")
    assert experts is not None and experts.mesh_dim_names == ("efsdp", "ep")
    out: dict = {"holds": meshes.holds("actor"), "mesh": experts.mesh.tolist()}
    if meshes.holds("actor"):
        for dim in ("ep", "efsdp"):
            group = experts[dim].get_group()
            total = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(total, group=group)
            out[dim] = (dist.get_process_group_ranks(group), total.item())
    dist.barrier()  # the world's default group still matches on every rank
    return out


def _worker(rank: int, world: int) -> list[dict]:
    # The async placement (trainer ranks 0-3 of 6) and an actor on neither end of the world (ranks 1-4).
    inner = Placement(
        world, {"actor": RoleSpec("actor", 1, 4, ep=2), "rollout": RoleSpec("rollout", 0, world)}
    )
    return [_groups(Placement.asynchronous(world, 2, ep=2)), _groups(inner)]


def test_the_experts_mesh_of_an_actor_on_some_of_the_ranks() -> None:
    from spmdrl.testing.spawn import run_distributed

    results = run_distributed(_worker, WORLD)
    for first, placement in ((0, 0), (1, 1)):
        actor = list(range(first, first + 4))
        for rank, res in enumerate(r[placement] for r in results):
            assert res["mesh"] == [[first, first + 1], [first + 2, first + 3]]
            assert res["holds"] == (rank in actor)
            if rank not in actor:
                continue
            i = rank - first
            ep_ranks = [first + 2 * (i // 2), first + 2 * (i // 2) + 1]
            efsdp_ranks = [first + i % 2, first + i % 2 + 2]
            assert res["ep"] == (ep_ranks, float(sum(ep_ranks))), (rank, res)
            assert res["efsdp"] == (efsdp_ranks, float(sum(efsdp_ranks))), (rank, res)
