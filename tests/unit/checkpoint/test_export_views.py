"""write_hf_dir (spmdrl/checkpoint/export.py) with full tensors that are views of a larger buffer: what the
bucketed gather gives for a parameter whose rows do not split evenly over the ranks (a critic's 1-row
value head on 2 ranks), which safetensors refuses to save as they are."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen2Config

from spmdrl.checkpoint.export import write_hf_dir


def test_views_of_a_gather_buffer_are_saved_as_their_own_tensors(tmp_path: Path) -> None:
    buffer = torch.arange(2 * 8, dtype=torch.float32).reshape(2, 8)  # a gathered (padded) buffer
    tensors = {"score.weight": buffer[:1], "other": buffer[:, :4]}  # a row view and a strided view
    write_hf_dir(tensors, Qwen2Config(hidden_size=8), tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(got["score.weight"], buffer[:1]) and torch.equal(got["other"], buffer[:, :4])
