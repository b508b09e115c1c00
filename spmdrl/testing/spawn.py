"""Run a function on N local processes with a gloo process group: our own small spawn helper.

torch.testing._internal has one, but it is private and moves between releases. Like torchrun,
this ends every process as soon as one fails and reports the failing rank's traceback.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from spmdrl.runtime import usable_cores
from spmdrl.testing import prefork

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    args: tuple,
    out: Any,
    streams: tuple[int, int] | None = None,
) -> None:
    if streams is not None:  # forked from the fork server: print where the caller prints
        prefork.attach_streams(*streams)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; the queue's own pickler would pass shared-memory
        # handles that die with this process before the parent reads them.
        out.put((rank, True, pickle.dumps(result)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))
        out.close()
        out.join_thread()  # flush the queue's feeder thread before os._exit skips it
        sys.stderr.flush()
        os._exit(1)


class SpawnError(RuntimeError):
    pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Calls ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; returns results by rank.

    ``fn`` must be importable (defined at module level). Raises SpawnError with the first failing
    rank's traceback, after killing the rest. The processes are forked from the session's fork server
    (spmdrl.testing.prefork), which has imported torch, transformers, vLLM and spmdrl; with
    ``SPMDRL_TEST_LAUNCHER=torchrun``, an ``env`` that changes what is read at import, or ``fresh=True``
    (a test of what a process imports or freezes), each is a fresh interpreter (multiprocessing's spawn).
    """
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    # Forked from the session's fork server, whose imports are done (spmdrl.testing.prefork), unless the
    # environment asks for what it did not import under; then a fresh interpreter each.
    preforked = (
        not fresh
        and os.environ.get("SPMDRL_TEST_LAUNCHER", "auto") != "torchrun"
        and prefork.compatible({**os.environ, **child_env})
    )
    ctx = prefork.context() if preforked else mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                r,
                world_size,
                port,
                child_env,
                args,
                out,
                prefork.caller_streams() if preforked else None,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise SpawnError(f"timed out after {timeout_s:.0f}s; finished ranks: {sorted(results)}")
            try:
                rank, ok, value = out.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead and out.empty():
                    raise SpawnError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise SpawnError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


def side_by_side(calls: Sequence[Callable[[], T]], ranks_each: int = 1) -> list[T]:
    """Each of ``calls`` (each starting processes of ``ranks_each`` ranks: a spawned group, a torchrun
    job), as many at once as the machine has cores for them (at least one); results in ``calls``' order.

    For independent small jobs, one rank each mostly, whose time is mostly their imports: a process
    spends ~9 s importing torch, transformers and vLLM on one core before its work, so two such jobs
    side by side on two cores take little more than one. (Jobs of longer engine work gained nothing on 2
    cores: test_weight_sync's GEMM paths, tried.)

    The first failure is raised at once, and so is an interrupt (a test's timeout): the jobs not started
    are dropped, and the ones running end by their own timeouts (run_distributed's, torchrun's)."""
    at_once = max(1, min(len(calls), usable_cores() // ranks_each))
    pool = ThreadPoolExecutor(at_once)
    try:
        runs = [pool.submit(call) for call in calls]
        wait(runs, return_when=FIRST_EXCEPTION)
        failed = [e for e in (run.exception() for run in runs if run.done()) if e is not None]
        if failed:
            raise failed[0]
        return [run.result() for run in runs]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def run_side_by_side(
    fn: Callable[..., Any],
    world_size: int,
    arg_sets: Sequence[tuple],
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[list[Any]]:
    """``run_distributed(fn, world_size, *args)`` for each ``args`` of ``arg_sets``, side by side
    (:func:`side_by_side`)."""
    return side_by_side(
        [
            functools.partial(run_distributed, fn, world_size, *args, timeout_s=timeout_s, env=env)
            for args in arg_sets
        ],
        world_size,
    )
