"""The HF export writer (spmdrl/checkpoint/export.py): huggingface_hub's sharded layout with an index
that transformers loads to the same weights, file modes that follow the umask (safetensors alone
leaves 0600), and an earlier export left intact when a new one fails midway."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmdrl.checkpoint.export import write_hf_dir
from spmdrl.testing.models import SMALL_QWEN2


def _model(*, tied: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**SMALL_QWEN2, "tie_word_embeddings": tied}))


@pytest.fixture
def umask() -> Iterator[None]:
    """Restores the process umask the test changes."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("tied", [True, False])
def test_weights_above_the_shard_size_are_sharded_and_load_to_the_same_weights(
    tmp_path: Path, tied: bool
) -> None:
    model = _model(tied=tied)
    out = tmp_path / "export"
    # The small Qwen2 is about 270 kB in fp32; 60 kB shards force several.
    write_hf_dir(
        dict(model.state_dict()),
        model.config,
        out,
        generation_config=model.generation_config,
        max_shard_size=60_000,
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 2 and not (out / "model.safetensors").exists(), shards
    assert all(name.startswith("model-0") and f"-of-{len(shards):05d}" in name for name in shards), shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = set(model.state_dict()) - ({"lm_head.weight"} if tied else set())  # tied: stored once
    assert set(index["weight_map"]) == stored
    assert set(index["weight_map"].values()) == set(shards)
    loaded = Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(loaded[name], value), name


def test_small_weights_are_one_file_without_an_index(tmp_path: Path) -> None:
    model = _model(tied=True)
    write_hf_dir(dict(model.state_dict()), model.config, tmp_path / "export")
    assert [p.name for p in (tmp_path / "export").glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "export" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_files_get_the_umask_mode_so_other_accounts_can_read_them(
    tmp_path: Path, umask: None, mask: int, mode: int
) -> None:
    os.umask(mask)
    model = _model(tied=True)
    out = tmp_path / "export"
    write_hf_dir(dict(model.state_dict()), model.config, out, max_shard_size=60_000)
    files = sorted(out.iterdir())
    assert any(f.suffix == ".safetensors" for f in files) and any(f.name == "config.json" for f in files)
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(mode) for f in files}


class _FailingTokenizer:
    def save_pretrained(self, path: Path) -> None:
        raise OSError("No space left on device")


def test_a_failed_export_leaves_the_earlier_one_intact(tmp_path: Path) -> None:
    model = _model(tied=True)
    out = tmp_path / "export"
    write_hf_dir(dict(model.state_dict()), model.config, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(OSError, match="No space left"):
        write_hf_dir(dict(model.state_dict()), model.config, out, tokenizer=_FailingTokenizer())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
