"""Placement: which ranks each role runs on, and the DeviceMeshes built from that.

This is the only module that does rank arithmetic. Every other module asks for a mesh by role
(``meshes.fsdp("actor")``) and gets a DeviceMesh over that role's ranks with named axes.

Today's placement is "colocated" (the hybrid engine): actor, ref, critic and rollout all span
every rank and time-share each device. :class:`RoleSpec` carries an explicit rank range so that a
split placement (for example actor on ranks 0-5, critic and ref on 6-7) is a new constructor, not
a new type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spmdrl.config import ConfigError

ROLES = ("actor", "ref", "critic", "rollout")


def rollout_tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """The rollout engines' tensor-parallel groups: blocks of ``tp`` consecutive ranks.

    This is the layout vLLM's external_launcher gives its own TP groups ([0..tp-1], [tp..2tp-1], ...),
    so ours must match it.
    """
    if tp < 1 or world_size % tp:
        raise ConfigError(
            f"rollout.tp={tp} must be >= 1 and divide the world size {world_size}: each engine spans tp "
            f"consecutive ranks; pick a divisor of {world_size}"
        )
    return [list(range(first, first + tp)) for first in range(0, world_size, tp)]


@dataclass(frozen=True)
class RoleSpec:
    name: str
    first_rank: int
    num_ranks: int
    # HSDP: replicate x shard within this role's ranks. 1 = plain FSDP.
    dp_replicate: int = 1

    @property
    def dp_shard(self) -> int:
        return self.num_ranks // self.dp_replicate


@dataclass(frozen=True)
class Placement:
    world_size: int
    roles: dict[str, RoleSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for spec in self.roles.values():
            if spec.first_rank < 0 or spec.first_rank + spec.num_ranks > self.world_size:
                raise ConfigError(
                    f"role '{spec.name}' wants ranks {spec.first_rank}..{spec.first_rank + spec.num_ranks - 1} "
                    f"but the world has {self.world_size} ranks (0..{self.world_size - 1})"
                )
            if spec.dp_replicate < 1 or spec.num_ranks % spec.dp_replicate:
                raise ConfigError(
                    f"parallel.dp_replicate={spec.dp_replicate} must divide the {spec.num_ranks} ranks of role "
                    f"'{spec.name}' (world size {self.world_size}); choose a divisor of {spec.num_ranks}"
                )

    @classmethod
    def colocated(cls, world_size: int, dp_replicate: int = 1) -> Placement:
        roles = {r: RoleSpec(r, 0, world_size, dp_replicate) for r in ROLES}
        return cls(world_size=world_size, roles=roles)

    def role(self, name: str) -> RoleSpec:
        if name not in self.roles:
            raise KeyError(f"no role '{name}' in this placement; roles: {', '.join(self.roles)}")
        return self.roles[name]

    def build_meshes(self, device_type: str) -> Meshes:
        return Meshes(self, device_type)


class Meshes:
    """DeviceMeshes per role, built once and cached. Roles on the same ranks share one mesh."""

    def __init__(self, placement: Placement, device_type: str) -> None:
        self.placement = placement
        self.device_type = device_type
        self._cache: dict[tuple[int, int, int], DeviceMesh] = {}

    def fsdp(self, role: str) -> DeviceMesh:
        """The mesh FSDP2 shards a role's module over: 1-D ("dp_shard",) or 2-D HSDP ("dp_replicate", "dp_shard")."""
        spec = self.placement.role(role)
        key = (spec.first_rank, spec.num_ranks, spec.dp_replicate)
        if key not in self._cache:
            self._cache[key] = self._build(spec)
        return self._cache[key]

    def _build(self, spec: RoleSpec) -> DeviceMesh:
        if spec.first_rank == 0 and spec.num_ranks == self.placement.world_size:
            if spec.dp_replicate == 1:
                return init_device_mesh(self.device_type, (spec.num_ranks,), mesh_dim_names=("dp_shard",))
            return init_device_mesh(
                self.device_type,
                (spec.dp_replicate, spec.dp_shard),
                mesh_dim_names=("dp_replicate", "dp_shard"),
            )
        # A role on a subset of ranks: an explicit rank layout (every rank must still call this).
        layout = torch.arange(spec.first_rank, spec.first_rank + spec.num_ranks)
        if spec.dp_replicate == 1:
            return DeviceMesh(self.device_type, layout, mesh_dim_names=("dp_shard",))
        return DeviceMesh(
            self.device_type,
            layout.view(spec.dp_replicate, spec.dp_shard),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
