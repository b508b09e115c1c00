"""The SFT recipe end to end under real torchrun (2 gloo ranks): metrics, config, export, learning."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow


@pytest.mark.guarantee("recipe:sft_tiny")
def test_sft_tiny_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=sft_tiny",
            f"trainer.output_dir={out}",
            "trainer.total_steps=12",
            "trainer.val_every=6",
            "tiny_task.num_train=512",
            "tiny_task.num_test=64",
            "trainer.global_batch_size=32",
            "trainer.micro_batch_size=8",
            "optim.warmup_steps=2",
            "logging.profile_steps=[3]",
        ],
        nproc=2,
        cwd=tmp_path,  # any working directory works
        timeout_s=600,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-4000:]
    assert f"output directory: {out}" in res.output

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    for key in ("train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s", "timing/step_s"):
        assert all(key in r for r in rows), key
    # logging.profile_steps: step 3's forward, backward and optimizer step traced on each rank.
    traced = sorted(p.name for p in (out / "profile" / "step-3").iterdir())
    assert traced == ["rank-0.json.gz", "rank-0.txt", "rank-1.json.gz", "rank-1.txt"]
    assert "aten::mm" in (out / "profile" / "step-3" / "rank-0.txt").read_text()
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert len(val) == 2
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] * 0.8, "training must reduce the loss"
    assert val[-1] < rows[0]["train/loss"]

    derived = json.loads((out / "derived.json").read_text())
    assert derived["per_rank_batch_size"] == 16 and derived["grad_accum_steps"] == 2
    assert "trainer:" in (out / "config.yaml").read_text()
    assert (out / "tensorboard").is_dir()

    # The export loads back into transformers and is a usable model.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    tok = AutoTokenizer.from_pretrained(out / "hf_model")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 apples."}], add_generation_prompt=True, return_tensors="pt"
    )
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_non_finite_loss_stops_with_a_clear_error(tmp_path: Path) -> None:
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=sft_tiny",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.total_steps=6",
            "tiny_task.num_train=128",
            "tiny_task.num_test=16",
            "trainer.global_batch_size=16",
            "trainer.micro_batch_size=8",
            "optim.lr=1e30",
            "optim.grad_clip=0",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=300,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode != 0
    assert "non-finite training loss" in res.output and "optim.lr" in res.output
    assert not (tmp_path / "run" / "hf_model").exists(), "no export of a diverged model"
