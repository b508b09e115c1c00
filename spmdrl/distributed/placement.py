"""Placement: which ranks each role runs on, and the DeviceMeshes and process groups built from that.

This is the only module that does rank arithmetic. Every other module asks for a mesh or a group by
role (``meshes.fsdp("actor")``, ``meshes.group("critic")``) and gets one over that role's ranks.

Two placements (docs/architecture.md has the picture):

- ``colocated`` (the hybrid engine, verl's default): actor, ref, critic and rollout all span every rank
  and time-share each device.
- ``split``: the actor and its reference train on ranks ``0 .. A-1``, the critic on ``A .. W-1``; each
  role has its own DeviceMesh and FSDP2 group, so their updates run at the same time. The rollout
  engine still spans every rank (so that the whole world generates; ``build_engine(ranks=...)`` could
  confine it, docs/rollout.md), and the actor's weights reach the critic ranks' engines by a
  broadcast over the *fanout* group (the first actor rank and the critic ranks).
- ``async`` (recipes/grpo_async.py): the actor and its reference train on ranks ``0 .. T-1``, the
  rollout engines and the reward function run on ``T .. W-1`` only. Rows reach the trainer ranks by
  point-to-point sends, weights reach the engines by the same fanout broadcast from rank 0 (a
  sender that loads no engine of its own); docs/async.md. The rollout ranks get an FSDP2 mesh of their
  own too: the reward model (reward_model.enable) is sharded over them, next to the engines.

On-policy distillation's teacher (teacher.path) joins ``colocated`` in one of two ways
(:meth:`Placement.with_teacher`): sharded over the actor's ranks like the reference
(``parallel.teacher_ranks=0``), or on ranks of its own, ``W-N .. W-1`` for ``parallel.teacher_ranks=N``,
which hold no actor. Then the actor and its reference train on ``0 .. W-N-1`` and the engines still span
every rank, as under ``split``: the teacher's ranks generate too, their engines served the actor's weights
by the same fanout broadcast, and the rows move to the teacher's ranks to be scored and to the actor's
ranks to be trained on (spmdrl/rl/role_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spmdrl.distributed.config import ParallelConfig
from spmdrl.errors import ConfigError

ROLES = ("actor", "ref", "critic", "rollout")
# Roles a placement holds only when the job has them: on-policy distillation's teacher (teacher.path), on
# the actor's ranks or on the last parallel.teacher_ranks ranks, which then hold no actor.
OPTIONAL_ROLES = ("teacher",)


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
    # Expert parallelism (parallel.ep, the actor only): groups of ep consecutive ranks each split every MoE
    # layer's experts among themselves; 1 = none. Colocated, async and with a teacher on ranks of its own
    # (the actor on ranks 0 .. A-1 then); not with split's critic nor with HSDP (plan_placement, check_ep_fits).
    ep: int = 1

    @property
    def dp_shard(self) -> int:
        return self.num_ranks // self.dp_replicate

    @property
    def ranks(self) -> list[int]:
        return list(range(self.first_rank, self.first_rank + self.num_ranks))

    def has(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.num_ranks

    def describe(self) -> str:
        last = self.first_rank + self.num_ranks - 1
        where = f"rank {last}" if self.num_ranks == 1 else f"ranks {self.first_rank}-{last}"
        mesh = (
            f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"FSDP {self.num_ranks}"
        )
        if self.ep > 1:
            mesh += f", experts EP {self.ep} x FSDP {self.num_ranks // self.ep}"
        return f"{self.name}: {where} ({mesh})"


@dataclass(frozen=True)
class Placement:
    world_size: int
    roles: dict[str, RoleSpec] = field(default_factory=dict)
    kind: str = "colocated"

    def __post_init__(self) -> None:
        for spec in self.roles.values():
            if spec.num_ranks < 1:
                raise ConfigError(f"role '{spec.name}' has no ranks (world size {self.world_size})")
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
            check_ep_fits(spec)
        trained = [self.roles[r] for r in ("actor", "critic") if r in self.roles]
        if len(trained) == 2 and trained[0].ranks != trained[1].ranks:
            a, c = trained
            if set(a.ranks) & set(c.ranks):
                raise ConfigError(
                    f"the actor's ranks {a.ranks} and the critic's {c.ranks} overlap without being the same; "
                    "a rank holds either both roles (colocated) or one"
                )

    @classmethod
    def colocated(cls, world_size: int, dp_replicate: int = 1, ep: int = 1) -> Placement:
        roles = {r: RoleSpec(r, 0, world_size, dp_replicate, ep if r == "actor" else 1) for r in ROLES}
        return cls(world_size=world_size, roles=roles, kind="colocated")

    @classmethod
    def split(cls, world_size: int, critic_ranks: int, dp_replicate: int = 1, ep: int = 1) -> Placement:
        """Actor and ref on the first ``world_size - critic_ranks`` ranks, the critic on the rest."""
        actor_ranks = world_size - critic_ranks
        return cls(
            world_size=world_size,
            roles={
                "actor": RoleSpec("actor", 0, actor_ranks, dp_replicate, ep),
                "ref": RoleSpec("ref", 0, actor_ranks, dp_replicate),
                "critic": RoleSpec("critic", actor_ranks, critic_ranks, dp_replicate),
                "rollout": RoleSpec("rollout", 0, world_size),
            },
            kind="split",
        )

    @classmethod
    def asynchronous(
        cls, world_size: int, rollout_ranks: int, dp_replicate: int = 1, ep: int = 1
    ) -> Placement:
        """Actor and ref on the first ``world_size - rollout_ranks`` ranks, the engines on the rest."""
        trainer_ranks = world_size - rollout_ranks
        return cls(
            world_size=world_size,
            roles={
                "actor": RoleSpec("actor", 0, trainer_ranks, dp_replicate, ep),
                "ref": RoleSpec("ref", 0, trainer_ranks, dp_replicate),
                "rollout": RoleSpec("rollout", trainer_ranks, rollout_ranks),
            },
            kind="async",
        )

    def with_teacher(self, teacher_ranks: int) -> Placement:
        """This placement with on-policy distillation's teacher: sharded over the actor's ranks (0), or on the
        last ``teacher_ranks`` ranks of the world, which then hold no actor: the actor and its reference
        shrink to the ranks before them (the engines keep spanning every rank). Colocated only."""
        if not teacher_ranks:
            actor = self.role("actor")
            spec = RoleSpec("teacher", actor.first_rank, actor.num_ranks)
            return Placement(self.world_size, {**self.roles, "teacher": spec}, self.kind)
        w = self.world_size
        if self.kind != "colocated":
            raise ConfigError(
                f"parallel.teacher_ranks={teacher_ranks} puts the teacher on ranks of its own next to a colocated "
                f"actor; parallel.placement={self.kind} already gives ranks to another role: set "
                "parallel.placement=colocated (entry: grpo, as in recipe=opd_tiny), or parallel.teacher_ranks=0"
            )
        if not 1 <= teacher_ranks < w:
            raise ConfigError(
                f"parallel.teacher_ranks={teacher_ranks} does not fit the world of {w} ranks: the teacher's own "
                f"ranks are the last N and the actor needs at least one before them; pick 1..{w - 1} (or "
                "start more processes), or 0 to shard the teacher over the actor's ranks"
            )
        actor = self.role("actor")
        a = w - teacher_ranks
        # The trained roles (a colocated placement lists the critic too, with the actor) shrink together;
        # the actor keeps parallel.ep, its ep groups now within ranks 0 .. a-1 (checked to divide them).
        shrunk = {
            r: RoleSpec(r, 0, a, actor.dp_replicate, actor.ep if r == "actor" else 1)
            for r in ("actor", "ref", "critic")
            if r in self.roles
        }
        roles = {**self.roles, **shrunk, "teacher": RoleSpec("teacher", a, teacher_ranks)}
        return Placement(w, roles, self.kind)

    @property
    def teacher_apart(self) -> bool:
        """Whether the teacher is on ranks of its own (parallel.teacher_ranks): the rows go to it to be scored,
        and to the actor's ranks to be trained on."""
        return "teacher" in self.roles and not self.roles["teacher"].has(self.role("actor").first_rank)

    @property
    def is_split(self) -> bool:
        return self.kind == "split"

    @property
    def is_async(self) -> bool:
        return self.kind == "async"

    def role(self, name: str) -> RoleSpec:
        if name not in self.roles:
            raise KeyError(f"no role '{name}' in this placement; roles: {', '.join(self.roles)}")
        return self.roles[name]

    def fanout_ranks(self) -> list[int]:
        """split: the first actor rank, which forwards each full weight, and the ranks that receive them."""
        if self.is_async:  # the first trainer rank and every rollout rank
            return [self.role("actor").first_rank, *self.role("rollout").ranks]
        if self.teacher_apart:  # the teacher's own ranks generate too
            return [self.role("actor").first_rank, *self.role("teacher").ranks]
        return [self.role("actor").first_rank, *self.role("critic").ranks] if self.is_split else []

    def describe(self) -> str:
        parts = [self.roles[r].describe() for r in ("actor", "ref", "critic", "teacher") if r in self.roles]
        if self.teacher_apart:
            parts[-1] = parts[-1].removesuffix(")") + ", no actor)"
        if self.is_async:
            engines = (
                self.roles["rollout"]
                .describe()
                .replace(f"(FSDP {self.roles['rollout'].num_ranks})", "(engines)")
            )
            return f"{self.kind}: " + ", ".join(parts) + "; " + engines
        return f"{self.kind}: " + ", ".join(parts) + f"; rollout on all {self.world_size} ranks"

    def build_meshes(self, device_type: str) -> Meshes:
        return Meshes(self, device_type)


def plan_placement(
    p: ParallelConfig,
    world_size: int,
    *,
    needs_critic: bool,
    asynchronous: bool = False,
    teacher: bool = False,
) -> Placement:
    """The placement ``parallel.*`` asks for on ``world_size`` ranks, or a ConfigError naming the fix.
    ``asynchronous``: the caller is the asynchronous loop (entry grpo_async), the only one that runs
    parallel.placement=async, and only that. ``teacher``: the job distils from a teacher (teacher.path),
    placed by parallel.teacher_ranks.

    Runs before any model or engine is built.
    """
    if p.teacher_ranks and not teacher:
        raise ConfigError(
            f"parallel.teacher_ranks={p.teacher_ranks} places a teacher, but the job has none: set teacher.path "
            "(on-policy distillation, as in recipe=opd_tiny), or parallel.teacher_ranks=0"
        )
    placement = _plan(p, world_size, needs_critic=needs_critic, asynchronous=asynchronous)
    if not needs_critic and "critic" in placement.roles:
        # A job without a value model has no critic role (the plan line lists the roles that run); the
        # colocated critic's ranks were the actor's, so no mesh or group changes.
        roles = {name: spec for name, spec in placement.roles.items() if name != "critic"}
        placement = Placement(placement.world_size, roles, placement.kind)
    return placement.with_teacher(p.teacher_ranks) if teacher else placement


def _plan(p: ParallelConfig, world_size: int, *, needs_critic: bool, asynchronous: bool) -> Placement:
    if asynchronous or p.placement == "async":
        return _plan_async(p, world_size, asynchronous=asynchronous)
    if p.placement == "colocated":
        return Placement.colocated(world_size, p.dp_replicate, p.ep)
    if not needs_critic:
        raise ConfigError(
            "parallel.placement=split puts the critic on ranks of its own, but this recipe trains no critic: "
            "use parallel.placement=colocated, or PPO (entry: ppo with algorithm.adv_estimator=gae, as in "
            "recipe=ppo_tiny)"
        )
    if world_size < 2:
        raise ConfigError(
            f"parallel.placement=split needs at least 2 ranks (one actor, one critic); the world has "
            f"{world_size}: start more processes (torchrun --nproc_per_node) or use parallel.placement=colocated"
        )
    critic = p.critic_ranks or world_size // 2
    if not 1 <= critic < world_size:
        raise ConfigError(
            f"parallel.critic_ranks={p.critic_ranks} must leave at least one rank to each role of the "
            f"{world_size}-rank world: pick 1..{world_size - 1} (0 = half)"
        )
    return Placement.split(world_size, critic, p.dp_replicate, p.ep)


def _plan_async(p: ParallelConfig, world_size: int, *, asynchronous: bool) -> Placement:
    if not asynchronous:
        raise ConfigError(
            "parallel.placement=async needs the asynchronous loop: set entry: grpo_async (recipes/grpo_async.py, "
            "as in recipe=grpo_async_tiny), or use parallel.placement=colocated"
        )
    if p.placement != "async":
        raise ConfigError(
            f"entry grpo_async (recipes/grpo_async.py) runs only parallel.placement=async, got "
            f"{p.placement!r}: set parallel.placement=async, or entry: grpo (colocated) / entry: ppo (split)"
        )
    if world_size < 2:
        raise ConfigError(
            f"parallel.placement=async needs at least 2 ranks (one trainer, one rollout); the world has "
            f"{world_size}: start more processes (torchrun --nproc_per_node)"
        )
    rollout = p.rollout_ranks or world_size // 2
    if not 1 <= rollout < world_size:
        raise ConfigError(
            f"parallel.rollout_ranks={p.rollout_ranks} must leave at least one trainer rank and one rollout "
            f"rank in the {world_size}-rank world: pick 1..{world_size - 1} (0 = half)"
        )
    return Placement.asynchronous(world_size, rollout, p.dp_replicate, p.ep)


def check_ep_fits(spec: RoleSpec) -> None:
    """parallel.ep against a role's ranks (against the model's expert count: spmdrl.models.families.check_ep)."""
    if spec.ep == 1:
        return
    if spec.ep < 1 or spec.num_ranks % spec.ep:
        divisors = ", ".join(str(d) for d in range(1, spec.num_ranks + 1) if spec.num_ranks % d == 0)
        raise ConfigError(
            f"parallel.ep={spec.ep} must divide the {spec.num_ranks} ranks of role '{spec.name}': its ranks form "
            f"groups of ep consecutive ranks that split the experts; pick one of {divisors} (1 = no expert "
            "parallelism), or give the role a multiple of ep ranks: start more processes, or (the actor has the "
            "ranks the others leave it) choose parallel.critic_ranks (placement split), parallel.rollout_ranks "
            "(placement async) or parallel.teacher_ranks to leave it one"
        )
    if spec.dp_replicate > 1:
        raise ConfigError(
            f"parallel.ep={spec.ep} with parallel.dp_replicate={spec.dp_replicate} (HSDP) is not supported: "
            "the experts' mesh has no replicate dimension; set parallel.dp_replicate=1"
        )


class Meshes:
    """DeviceMeshes and process groups per role, all built here at once.

    torch requires every rank to take part in creating every group, including the groups of roles it
    does not hold, so everything is created eagerly, in one fixed order. Roles on the same ranks share
    one mesh and one group.
    """

    def __init__(self, placement: Placement, device_type: str) -> None:
        self.placement = placement
        self.device_type = device_type
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._meshes: dict[tuple[int, int, int], DeviceMesh] = {}
        self._groups: dict[tuple[int, int], dist.ProcessGroup | None] = {}
        self._experts: dict[str, DeviceMesh] = {}
        for name in (*ROLES, *OPTIONAL_ROLES):
            if name not in placement.roles:
                continue
            spec = placement.roles[name]
            # The engines need no mesh; under async the rollout ranks' reward model does (FSDP2 over them).
            if name != "rollout" or placement.is_async:
                key = (spec.first_rank, spec.num_ranks, spec.dp_replicate)
                if key not in self._meshes:
                    self._meshes[key] = self._build(spec)
                if spec.ep > 1:
                    # The same ranks as the role's mesh, unflattened (ranks r and r + 1 in one ep group):
                    # FSDP2 joins the experts' efsdp and ep dimensions, which needs one root mesh. Every rank
                    # runs this, also one outside the role (async's rollout ranks, a teacher's own ranks):
                    # unflattening creates each efsdp and ep group with new_group, which all ranks must call.
                    self._experts[name] = self._meshes[key]._unflatten(
                        0, (spec.num_ranks // spec.ep, spec.ep), ("efsdp", "ep")
                    )
            gkey = (spec.first_rank, spec.num_ranks)
            if gkey not in self._groups:
                whole = spec.num_ranks == placement.world_size
                self._groups[gkey] = None if whole else dist.new_group(spec.ranks)
        fan = placement.fanout_ranks()
        self.fanout_group = dist.new_group(fan) if fan else None

    def fsdp(self, role: str) -> DeviceMesh:
        """The mesh FSDP2 shards a role's module over: 1-D ("dp_shard",) or 2-D HSDP ("dp_replicate", "dp_shard")."""
        spec = self.placement.role(role)
        return self._meshes[(spec.first_rank, spec.num_ranks, spec.dp_replicate)]

    def experts(self, role: str) -> DeviceMesh | None:
        """parallel.ep > 1: the 2-D ("efsdp", "ep") mesh of a role's experts (each ep group of consecutive
        ranks splits the experts; efsdp: the ranks holding the same experts, over which FSDP2 shards them);
        None without expert parallelism."""
        return self._experts.get(role)

    def group(self, role: str) -> dist.ProcessGroup | None:
        """The process group over all of a role's ranks (None: the default group, the whole world)."""
        spec = self.placement.role(role)
        return self._groups[(spec.first_rank, spec.num_ranks)]

    def holds(self, role: str) -> bool:
        """Whether this rank runs ``role``."""
        return self.placement.role(role).has(self.rank)

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
