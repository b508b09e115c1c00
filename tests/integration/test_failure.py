"""One rank's failure ends the whole torchrun job promptly, with the cause printed and a non-zero exit."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from spmdrl.testing.launch import torchrun
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist
    from spmdrl.train import run_recipe
    from spmdrl.runtime import start_run

    def main(cfg):
        run = start_run(cfg)
        if run.env.rank == 1:
            raise RuntimeError("reward server exploded on purpose")
        # Rank 0 waits in a collective that rank 1 never joins: without the failure path this
        # blocks until the collective timeout (set to 5 minutes below).
        dist.all_reduce(torch.ones(1))
        time.sleep(600)

    if __name__ == "__main__":
        run_recipe(main)
    """
)


@pytest.mark.guarantee("errors:rank_failure")
def test_exception_on_one_rank_ends_the_job(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(SCRIPT)
    res = torchrun(
        [str(script), f"trainer.output_dir={tmp_path / 'out'}", "trainer.collective_timeout_min=5"],
        nproc=2,
        timeout_s=240,
    )
    assert res.returncode != 0
    assert "reward server exploded on purpose" in res.output
    assert "rank 1 failed" in res.output
    assert res.wall_s < 90, f"the job took {res.wall_s:.0f}s to end; a failure must end it promptly"


def test_config_error_exits_2_before_any_work(tmp_path: Path) -> None:
    res = torchrun(["-m", "spmdrl.train", "recipe=sft_tiny", "optim.lrr=1"], nproc=2, timeout_s=120)
    assert res.returncode != 0
    assert "config error: unknown config key 'optim.lrr'. Did you mean 'optim.lr'?" in res.output
    # printed once (rank 0), not once per rank
    assert res.output.count("Did you mean 'optim.lr'") == 1


def _slow_writer_worker(rank: int, world: int) -> dict:
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from spmdrl.distributed.env import wait_for

    # A group whose collectives time out after 1 s stands for trainer.collective_timeout_min.
    short = dist.new_group(timeout=datetime.timedelta(seconds=1))
    out = {}
    if rank == 0:
        time.sleep(3)  # an export to slow storage
    try:
        dist.barrier(group=short)
        out["barrier"] = "ok"
    except Exception as e:  # noqa: BLE001 - the failure being demonstrated
        out["barrier"] = type(e).__name__
    t0 = time.time()
    if rank == 0:
        time.sleep(3)
    wait_for("slow-export", writer=rank == 0)
    out["waited_s"] = time.time() - t0
    x = torch.ones(1)
    dist.all_reduce(x)
    out["after"] = float(x)
    return out


def test_work_one_rank_does_is_waited_for_outside_collectives() -> None:
    """A 3 s export on rank 0 breaks a barrier whose timeout is 1 s; ``wait_for`` waits it out."""
    res = run_distributed(_slow_writer_worker, 2, timeout_s=120)
    assert res[1]["barrier"] != "ok"  # the collective timed out while rank 0 worked alone
    assert res[1]["waited_s"] >= 2.5 and all(r["after"] == 2.0 for r in res)
