"""Names of vLLM-CPU's tensor-parallel shared-memory segments: unique to each engine build.

On CPU with ``rollout.tp >= 2`` vLLM all-reduces through POSIX shared memory (``_CPUSHMDistributed``
in ``distributed/device_communicators/cpu_communicator.py``): each rank of a TP group creates the
segment ``<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>`` with ``O_CREAT | O_EXCL`` and maps its
peers'. ``CPUWorker.init_device`` (``v1/worker/cpu_worker.py``) sets ``VLLM_DIST_IDENT`` from the
distributed init method, which ``external_launcher`` makes ``env://`` for every job: the ident is
``//`` and every job on a machine names its segments ``/dev/shm/-tp:0-[0-1]-cpushm_0``, ... (vLLM
0.32). A job built while another one runs then fails (``create shm in SHMManager failed. errno: 17``),
and so does every later job once one was killed (``kill -9``, torchrun ending a failed rank's peers):
vLLM unlinks the names only from a C++ static destructor, at a normal exit.

What is done instead:

- the ident is ``spmdrl-<random hex>``, drawn on the engine's first rank and all-gathered, so the
  ranks of one engine agree (vLLM checks that they do, and otherwise quietly falls back to gloo) and
  no other build, running or killed, shares its names;
- vLLM gets it through :mod:`spmdrl.rollout.cpu_shm_worker` (``worker_cls``): setting the variable
  before the build is not enough, since ``init_device`` overwrites it just before it creates the
  groups;
- after the build, :func:`tp_all_reduce` reads which all-reduce vLLM's TP group took; the engine logs it
  once, as a warning where the library has the shared-memory one and the group still fell back to gloo
  (vLLM says so only at INFO, which spmdrl's log level hides);
- once every rank of the engine has built (every rank has mapped every segment of its group), the
  names are unlinked: the memory stays mapped while the engine lives and is freed with the last
  process that maps it, so a job killed afterwards leaves nothing in ``/dev/shm``. A failed build
  unlinks what it created as well.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

# vLLM imports the worker by qualified name (EngineArgs.worker_cls) when it builds the engine.
WORKER_CLS = "spmdrl.rollout.cpu_shm_worker.CPUWorker"
# Where shm_open (glibc, Linux) keeps the segments; elsewhere the names are still unique, not unlinked.
SHM_DIR = Path("/dev/shm")
PREFIX = "spmdrl-"

# The ident of the engine this process is building, for the worker vLLM creates inside that build
# (external_launcher: in this process). None outside a build.
_building: str | None = None


def building_ident() -> str | None:
    return _building


def shm_all_reduce_available() -> bool:
    """Whether this vLLM library has the shared-memory all-reduce at all (vLLM's AVX2 build has not)."""
    import torch

    return hasattr(torch.ops._C, "init_shm_manager")


def tp_all_reduce() -> str:
    """Which all-reduce the built engine's TP group uses: ``"shared memory"`` or ``"gloo"`` (vLLM's
    fallback). Call after the build, in the process that built it (external_launcher)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    module = getattr(get_tp_group().device_communicator, "dist_module", None)
    return "shared memory" if isinstance(module, _CPUSHMDistributed) else "gloo"


@dataclass(frozen=True)
class SegmentNames:
    """One engine build's shared-memory ident; every rank of the engine holds the same one."""

    ident: str

    @classmethod
    def agree(cls, group: dist.ProcessGroup | None) -> SegmentNames:
        """Every rank of the engine (``group``; None: the default group) together, before the build."""
        mine = PREFIX + secrets.token_hex(8)  # os.urandom: the trainer's RNG streams are untouched
        everyone: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        assert everyone[0] is not None
        return cls(everyone[0])

    @contextlib.contextmanager
    def building(self, group: dist.ProcessGroup | None) -> Iterator[None]:
        """Around the engine's construction on every rank of ``group``; afterwards, checks that vLLM took
        the ident on every rank and unlinks the names."""
        global _building
        _building = self.ident
        try:
            yield
        except BaseException:
            self.unlink()  # the peers' builds fail too; nothing may be left behind
            raise
        finally:
            _building = None
        took = os.environ.get("VLLM_DIST_IDENT") == self.ident
        # Also a barrier: past it every rank has built, so no peer still has a segment to open.
        everyone: list[bool | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, took, group=group)
        self.unlink()
        if not all(everyone):
            raise RuntimeError(
                f"vLLM did not name its CPU shared-memory segments after {self.ident!r} on every engine "
                f"rank (which did, by rank: {everyone}): spmdrl.rollout.cpu_shm_worker no longer matches "
                "how this vLLM release derives VLLM_DIST_IDENT, and concurrent tp>=2 jobs would collide"
            )

    def unlink(self) -> list[str]:
        """Removes this build's names from this node's ``/dev/shm`` (mappings stay valid); the removed."""
        if not SHM_DIR.is_dir():
            return []
        removed = []
        for name in sorted(os.listdir(SHM_DIR)):
            if name.startswith(f"{self.ident}-"):
                with contextlib.suppress(FileNotFoundError):  # a peer on this node was first
                    os.unlink(SHM_DIR / name)
                    removed.append(name)
        return removed
