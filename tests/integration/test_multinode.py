"""Two torchrun agents on this machine as two "nodes": the multi-node launch path end to end.

The Slurm template starts one torchrun per node that meet through a c10d rendezvous (no
--node_rank, no --standalone). Here two agents of one process each do the same on 127.0.0.1 and run
a short grpo_tiny; the run must finish on both, with world size 2, metrics up to the last step and the
exported model. This exercises what a single `torchrun --nproc_per_node=2` does not: rank assignment
by the rendezvous, the agent store shared between two agents, and LOCAL_WORLD_SIZE=1 per node.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.spawn import free_port

pytestmark = pytest.mark.slow

TIMEOUT_S = 900.0
TOTAL_STEPS = 2

OVERRIDES = [
    "warmstart.total_steps=8",
    f"trainer.total_steps={TOTAL_STEPS}",
    f"trainer.val_every={TOTAL_STEPS}",
    "tiny_task.num_train=256",
    "tiny_task.num_test=32",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=8",
]


def _agent_cmd(endpoint: str, rdzv_id: str, out: Path) -> list[str]:
    """One node's torchrun: one worker, c10d rendezvous with the other agent."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={rdzv_id}",
        "--max-restarts=0",
        "-m",
        "spmdrl.train",
        "recipe=grpo_tiny",
        f"trainer.output_dir={out}",
        *OVERRIDES,
    ]


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Every agent's exit code; on timeout every agent still running is killed and the test fails."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            _stop(procs)
            pytest.fail(f"the two agents did not finish within {timeout_s:.0f} s")
    return codes


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM first: an agent then stops its workers (they run in sessions of their own, so a
    SIGKILLed agent would leave them running); SIGKILL whatever is left after the grace period."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_two_agents_as_two_nodes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = f"spmdrl-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # The agents log their rendezvous result (group_rank, group_world_size) at INFO.
        "LOGLEVEL": "INFO",
        "SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl")),
    }
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = []
    for log_path in logs:
        with log_path.open("w") as fh:
            # Files, not pipes: a full pipe buffer would block an agent that nobody is reading.
            procs.append(
                subprocess.Popen(
                    _agent_cmd(endpoint, rdzv_id, out),
                    cwd=tmp_path,
                    env=env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                )
            )
    codes = _wait_all(procs, TIMEOUT_S)
    text = [p.read_text() for p in logs]
    assert codes == [0, 0], "\n\n".join(
        f"--- node {i} (exit {c})\n{t[-5000:]}" for i, (c, t) in enumerate(zip(codes, text, strict=True))
    )

    # The rendezvous made each agent one node of two: node ranks 0 and 1, in either order.
    group_ranks = sorted(r for t in text for r in set(re.findall(r"group_rank=(\d+)", t)))
    assert group_ranks == ["0", "1"], group_ranks
    assert all("group_world_size=2" in t for t in text)
    # Rank 0 (whichever agent the rendezvous gave it to) logs at INFO.
    assert any("world size 2 on" in t for t in text), [t[-2000:] for t in text]
    rows = read_metrics(out / "metrics.jsonl")
    assert rows and rows[-1]["step"] == TOTAL_STEPS, [r["step"] for r in rows]
    assert (out / "hf_model").is_dir() and (out / "hf_model" / "model.safetensors").exists()
