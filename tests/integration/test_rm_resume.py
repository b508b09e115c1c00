"""recipe=rm_tiny resumes exactly (recipes/rm.py), under real torchrun with 2 gloo ranks.

A straight run of 8 steps, against the same run stopped (the whole job SIGKILLed) once its step-4
checkpoint is complete and launched again with the same command: the second launch skips the SFT warm-start
(its export is next to the checkpoints), reads the policy's preference pairs the first one sampled
(policy_pairs.json) instead of sampling again, resumes at step 4 and ends with the same metrics and reward
model, bit for bit (CPU: the same kernels on the same inputs).
"""

from __future__ import annotations

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
    "recipe=rm_tiny",
    # A short warm-start, a few prompts: enough for policy pairs (rm.pairs=both, the recipe's), in seconds.
    "warmstart.total_steps=40",
    "tiny_task.num_train=512",
    "tiny_task.num_test=32",
    "rm.num_prompts=48",
    "rollout.n=8",
    "trainer.total_steps=8",
    "trainer.save_every=4",
    "trainer.val_every=4",
    "trainer.global_batch_size=16",
    # Micro-batches of one pair: steps slow enough that the stop lands before the next checkpoint.
    "trainer.micro_batch_size=1",
    "optim.warmup_steps=2",
]


def _launch(out: Path, cwd: Path) -> str:
    res = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={out}"], cwd=cwd, timeout_s=600, env=cache_env()
    )
    assert res.returncode == 0, res.output[-5000:]
    return res.output


def test_rm_tiny_stopped_and_resumed_equals_straight(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    _launch(straight, tmp_path)
    rows = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(9))  # step 0: the untrained head's validation
    assert [r["step"] for r in rows if "val/pairwise_accuracy" in r] == [0, 4, 8]
    assert any(r["train/grad_norm"] > 0 for r in rows[1:])

    # The same job, stopped hard once its step-4 checkpoint is complete (no chance to clean up) ...
    stopped = tmp_path / "stopped"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "-m", "spmdrl.train", *ARGS, f"trainer.output_dir={stopped}",
    ]  # fmt: skip
    with open(tmp_path / "first.log", "w") as log:
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
            if (stopped / "checkpoints" / "step-4" / "meta.json").is_file():
                # torchrun starts each worker in a session of its own: the workers first, then the agent.
                workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True)
                for pid in map(int, workers.stdout.split()):
                    os.kill(pid, signal.SIGKILL)
                agent.kill()
                killed = True
                break
            time.sleep(0.01)
        agent.wait(timeout=60)
    assert killed, (tmp_path / "first.log").read_text()[-3000:]
    ckpts = sorted(p.name for p in (stopped / "checkpoints").iterdir() if not p.name.startswith("."))
    assert ckpts == ["step-4"], f"the first launch went on past its step-4 checkpoint: {ckpts}"

    # ... then launched again with the same command: it resumes from step 4 and ends as the straight run.
    output = _launch(stopped, tmp_path)
    assert f"resumed from {stopped}/checkpoints/step-4: step 4 of 8" in output, output[-3000:]
    assert "warm-start done earlier" in output and "policy pairs from" in output, output[-3000:]
    pairs_a, pairs_b = (json.loads((d / "policy_pairs.json").read_text()) for d in (straight, stopped))
    assert pairs_a["train"] == pairs_b["train"] and pairs_a["val"] == pairs_b["val"]
    b = read_metrics(stopped / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(9))  # every step once: rows past the checkpoint redone
    assert comparable(rows) == comparable(b)
    wa = load_file(straight / "hf_model" / "model.safetensors")
    wb = load_file(stopped / "hf_model" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
