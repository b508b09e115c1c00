"""spmdrl.rollout.cpu_shm without vLLM: the ident the ranks agree on, and which names a build leaves.

The segments stand in as plain files under /dev/shm named as vLLM names them; the real engines are in
tests/integration/test_cpu_shm.py.
"""

from __future__ import annotations

import os

import pytest

from spmdrl.rollout.cpu_shm import SHM_DIR, SegmentNames


def _segment(ident: str, rank: int) -> str:
    name = f"{ident}-tp:0-[0-1]-cpushm_{rank}"
    (SHM_DIR / name).write_bytes(b"\0" * 64)
    return name


def _left(ident: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{ident}-"))


def _two_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    names = SegmentNames.agree(None)
    out["ident"] = names.ident

    # A build vLLM named after the ident: the names are gone afterwards, on every rank.
    with names.building(None):
        _segment(names.ident, rank)
        os.environ["VLLM_DIST_IDENT"] = names.ident
    dist.barrier()
    out["left_after_build"] = _left(names.ident)

    # A build that fails on this rank: its names go at once (no collective: the peers may be gone).
    failed = SegmentNames(f"{names.ident}x{rank}")
    try:
        with failed.building(None):
            _segment(failed.ident, rank)
            raise ValueError("engine build failed")
    except ValueError:
        out["left_after_failure"] = _left(failed.ident)

    # vLLM ignored the ident on one rank: every rank raises, and the names still go.
    other = SegmentNames.agree(None)
    out["second_ident"] = other.ident
    try:
        with other.building(None):
            _segment(other.ident, rank)
            os.environ["VLLM_DIST_IDENT"] = other.ident if rank == 0 else "//"
    except RuntimeError as e:
        out["not_taken"] = str(e)
    dist.barrier()
    out["left_after_not_taken"] = _left(other.ident)
    return out


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="POSIX shared memory is not under /dev/shm here")
def test_segment_names_agree_and_are_unlinked() -> None:
    from spmdrl.testing.spawn import run_distributed

    r0, r1 = run_distributed(_two_ranks, 2, timeout_s=120)
    assert r0["ident"] == r1["ident"] and r0["ident"].startswith("spmdrl-")
    for res in (r0, r1):
        assert res["left_after_build"] == []
        assert res["left_after_failure"] == []
        assert "did not name its CPU shared-memory segments" in res["not_taken"]
        assert res["left_after_not_taken"] == []
    assert r0["second_ident"] == r1["second_ident"] != r0["ident"]  # a new ident for each build
