"""Process-group start-up: device choice, backend, and a world of one when not under torchrun."""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_min: float = 10.0) -> DistEnv:
    """Initializes the default process group (NCCL on CUDA, gloo on CPU) from torchrun's env vars.

    Started without torchrun, it forms a world of one on a free local port, so
    ``python -m spmdrl.train`` works as a single process too.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        # "cpu:gloo,cuda:nccl" lets CPU-side collectives (object broadcasts) work next to NCCL.
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=timeout_min)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
            **_attempt_store(rank, world_size, timeout),
        )
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun, the agent's store with a prefix per restart attempt.

    torchrun keeps one store for all attempts of a job; workers restarted by --max-restarts would read
    the gloo addresses their dead predecessors published there and fail to connect ("Gloo
    connectFullMesh failed ... Connection refused"). Keys under a per-attempt prefix cannot collide.
    Started any other way, the default env:// rendezvous is used.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    return {
        "store": dist.PrefixStore(f"spmdrl/attempt-{attempt}", base),
        "rank": rank,
        "world_size": world_size,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_WAIT_COUNTS: dict[str, int] = {}


def wait_for(name: str, *, writer: bool, timeout_min: float = 120.0, report_every_s: float = 300.0) -> None:
    """The ranks that wait for work only one rank does (an export, a download) wait here, not in a
    collective: a barrier would count that work against trainer.collective_timeout_min and kill a job
    writing a large model to slow storage. The writer calls it with ``writer=True`` when done.

    Every rank taking part calls it with the same ``name``, the same number of times. A waiting rank logs
    every ``report_every_s`` that it still waits and for what, so a writer that never comes shows in the
    log long before ``timeout_min`` ends the wait with an error naming it.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    count = _WAIT_COUNTS.get(name, 0)
    _WAIT_COUNTS[name] = count + 1
    key = f"spmdrl/done/{name}/{count}"
    store = dist.distributed_c10d._get_default_store()
    if writer:
        store.set(key, b"1")
        return
    start = time.monotonic()
    while True:
        left = timeout_min * 60 - (time.monotonic() - start)
        try:
            store.wait([key], datetime.timedelta(seconds=max(min(report_every_s, left), 0.001)))
            return
        except dist.DistStoreError as e:
            waited = time.monotonic() - start
            if waited >= timeout_min * 60:
                raise RuntimeError(
                    f"rank {dist.get_rank()} waited {waited / 60:.1f} min for {name!r} (call {count + 1}), "
                    "which one rank does and the others wait for (an export, a model download or build), "
                    "and it never finished: that rank is stuck or never started it; its log says which"
                ) from e
            log.warning(
                "rank %d: still waiting for %r (call %d) after %.0f s: one rank does it (an export, a model "
                "download or build) and the others wait",
                dist.get_rank(),
                name,
                count + 1,
                waited,
            )


def broadcast_object(value: T, src: int = 0) -> T:
    """Rank ``src``'s Python object on every rank (small things off the hot path: a directory, a role's
    metrics)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_str(value: str, src: int = 0) -> str:
    """Rank ``src``'s string on every rank (for example the output directory)."""
    return broadcast_object(value, src)
