"""tp=2 CPU engines of different jobs on one machine: two at once, and one after a killed one.

vLLM-CPU's TP all-reduce works through shared-memory segments that vLLM names after the distributed
init method, which is the same (``env://``) for every ``external_launcher`` job. Without per-build
names (spmdrl.rollout.cpu_shm) the second of two concurrent jobs fails to build ("create shm in
SHMManager failed. errno: 17"), and so does every job started after one was killed, whose segments
stay in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from spmdrl.rollout.cpu_shm import SHM_DIR

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
PROMPTS = [[1, 10, 20, 30], [1, 40, 50, 60, 70], [1, 100, 7]]
WAIT_S = 120.0


def _wait_for(path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _job(
    rank: int, world: int, model_dir: str, markers: str, name: str, other: str | None, kill: bool
) -> dict:
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    from spmdrl.config import RolloutConfig
    from spmdrl.rollout.engine import SamplingSpec, build_engine

    cfg = RolloutConfig(tp=2, cpu_kvcache_gib=0.25, max_num_seqs=8, seed=3)
    engine = build_engine(Path(model_dir), cfg, max_model_len=64, device_type="cpu")
    communicator = get_tp_group().device_communicator
    ident = os.environ["VLLM_DIST_IDENT"]
    out = dict(
        # Whether this CPU kind's vLLM library has the shared-memory all-reduce at all (vLLM's AVX2 build
        # does not: its TP goes through gloo, and nothing can collide).
        shm_available=hasattr(torch.ops._C, "init_shm_manager"),
        # The shared-memory all-reduce, not vLLM's silent fallback to gloo (which collides with nothing).
        shm=isinstance(getattr(communicator, "dist_module", None), _CPUSHMDistributed),
        # What the engine itself reports (and logs) about the same choice.
        reported=engine.tp_all_reduce,
        ident=ident,
        # Built: every rank mapped every segment, so the names are gone from /dev/shm already.
        names_left=sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{ident}-")),
    )
    dist.barrier()
    if rank == 0:
        (Path(markers) / f"{name}.ident").write_text(ident)
    if other is not None:  # both jobs hold their engines until the other has built too
        out["other_built"] = _wait_for(Path(markers) / f"{other}.ident", WAIT_S)
    if kill:  # as torchrun ending a failed job, or an OOM kill: no exit handlers run
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    greedy = engine.generate(PROMPTS, SamplingSpec(n=1, temperature=0.0, max_tokens=12))
    out["tokens"] = [g.token_ids for g in greedy]
    engine.close()
    return out


def _run(
    model_dir: Path, markers: Path, name: str, other: str | None = None, kill: bool = False
) -> list[dict]:
    from spmdrl.testing.spawn import run_distributed

    return run_distributed(
        _job, 2, str(model_dir), str(markers), name, other, kill, timeout_s=600, env=VLLM_ENV
    )


@pytest.mark.slow
@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="POSIX shared memory is not under /dev/shm here")
def test_tp2_jobs_concurrent_and_after_a_killed_one(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.testing.spawn import SpawnError

    model_dir = ensure_tiny_model(tmp_path / "models")
    markers = tmp_path / "markers"
    markers.mkdir()

    # Two jobs at once, each holding its engine until the other has built.
    results: dict[str, list[dict] | BaseException] = {}

    def run(name: str, other: str) -> None:
        try:
            results[name] = _run(model_dir, markers, name, other)
        except BaseException as e:  # noqa: BLE001 - asserted on below
            results[name] = e

    threads = [threading.Thread(target=run, args=names) for names in (("a", "b"), ("b", "a"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("a", "b"):
        assert not isinstance(results[name], BaseException), f"job {name} failed: {results[name]}"
    a, b = results["a"], results["b"]
    assert isinstance(a, list) and isinstance(b, list)
    if not any(res["shm_available"] for res in a + b):
        assert all(res["reported"] == "gloo" for res in a + b), a + b
        pytest.skip(
            "this CPU kind's vLLM library has no shared-memory all-reduce (torch.ops._C.init_shm_manager): "
            "tp=2 goes through gloo, so there is no segment to collide on"
        )
    for job in (a, b):
        for res in job:
            assert res["shm"] and res["other_built"] and res["names_left"] == [], res
            assert res["reported"] == "shared memory", res
        assert job[0]["ident"] == job[1]["ident"]
        assert job[0]["tokens"] == job[1]["tokens"]  # one engine: both ranks got its completions
    assert a[0]["ident"] != b[0]["ident"]
    assert a[0]["tokens"] == b[0]["tokens"]

    # A job killed while its engine lives leaves no segment behind, and the next job builds.
    with pytest.raises(SpawnError, match="exited with code -9"):
        _run(model_dir, markers, "killed", kill=True)
    killed = (markers / "killed.ident").read_text()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(killed)]
    after = _run(model_dir, markers, "after")
    assert all(res["shm"] for res in after)
    assert after[0]["ident"] not in (killed, a[0]["ident"], b[0]["ident"])
    assert after[0]["tokens"] == after[1]["tokens"] == a[0]["tokens"]
