"""SFT has RL's checkpoints, exact resume, overwrite guard, samples and curves (recipes/sft.py), under real
torchrun with 2 gloo ranks.

A straight run of 8 steps, against the same run whose worker is SIGKILLed after its step-2 checkpoint and
restarted by torchrun (--max-restarts=1): the restarted job resumes from the newest complete checkpoint and
ends with the same metrics and weights, bit for bit (CPU: the same kernels on the same inputs).
"""

from __future__ import annotations

import importlib.util
import json
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
    "recipe=sft_tiny",
    "trainer.total_steps=8",
    "trainer.save_every=2",
    "trainer.val_every=4",
    "tiny_task.num_train=512",
    "tiny_task.num_test=32",
    "trainer.global_batch_size=32",
    "trainer.micro_batch_size=8",
    "optim.warmup_steps=2",
    "logging.samples_per_log=3",
]


def _rank1_pid(agent: int) -> int | None:
    out = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
    for pid in map(int, out):
        try:
            if b"RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def test_sft_checkpoints_resume_exactly_and_refuse_a_second_run(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    res = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={straight}"],
        cwd=tmp_path,
        timeout_s=600,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-4000:]
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["step-6", "step-8"]
    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra (CI installs it)
        assert (straight / "curves.png").is_file()
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [4, 4, 4, 8, 8, 8]
    assert all(s["split"] == "val" and s["prompt"] and s["ground_truth"] for s in samples)
    rows = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all("val/exact_match" in r for r in rows if r["step"] in (4, 8))

    # The same job under torchrun's restarts; rank 1 dies once the step-2 checkpoint is complete.
    restarted = tmp_path / "restarted"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "spmdrl.train", *ARGS,
        f"trainer.output_dir={restarted}",
    ]  # fmt: skip
    with open(tmp_path / "torchrun.log", "w") as log:
        agent = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **cache_env()},
        )
        killed = False
        deadline = time.time() + 600
        while agent.poll() is None and time.time() < deadline:
            if not killed and (restarted / "checkpoints" / "step-2" / "meta.json").is_file():
                pid = _rank1_pid(agent.pid)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            time.sleep(0.05)
        if agent.poll() is None:
            agent.kill()
    output = (tmp_path / "torchrun.log").read_text()
    assert killed, "the run ended before its worker could be killed"
    assert agent.returncode == 0, output[-5000:]
    assert f"resumed from {restarted}/checkpoints/step-" in output, output[-3000:]
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(restarted / "metrics.jsonl")
    assert [r["step"] for r in b] == list(
        range(1, 9)
    )  # every step once: the rows after the checkpoint redone
    assert comparable(a) == comparable(b)
    wa = load_file(straight / "hf_model" / "model.safetensors")
    wb = load_file(restarted / "hf_model" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert (restarted / "samples.jsonl").read_text() == (straight / "samples.jsonl").read_text()

    # A new run into a directory that holds one, told not to resume, is refused before any model is built.
    again = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={straight}", "trainer.resume=off"],
        cwd=tmp_path,
        timeout_s=300,
        env=cache_env(),
        launcher="torchrun",  # its closing summary shows the worker's exit code
    )
    assert again.returncode != 0
    assert "already holds a run" in again.output, again.output[-3000:]
    # A refusal is the user's to fix: reported once, as a configuration error (exit 2 in torchrun's summary).
    assert again.output.count("already holds a run") == 1 and "exitcode  : 2" in again.output, again.output[
        -3000:
    ]
    assert [r["step"] for r in read_metrics(straight / "metrics.jsonl")] == list(range(1, 9))  # untouched
