"""LoRA exports (spmdrl/checkpoint/adapter.py, export_checkpoint): a LoRA checkpoint (its DCP state holds the
adapters only) exports merged into the base model its adapter_config.json names, or as the adapter alone in
PEFT's format; the adapter read back and merged into the base gives the merged export, whose logits are the
adapted model's. The checkpoint is written by DCP on one process (no process group), as export reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from spmdrl.checkpoint import adapter
from spmdrl.checkpoint.export import export_checkpoint, write_hf_metadata
from spmdrl.config import LoraConfig
from spmdrl.export import main as export_main
from spmdrl.models.build import read_safetensors
from spmdrl.models.lora import LoraLinear, apply_lora, is_adapter_param, merge_state_dict
from spmdrl.models.tiny import build_tokenizer
from spmdrl.testing.models import SMALL_QWEN2


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Qwen2ForCausalLM]:
    """(step dir, base model dir, the adapted model) of a checkpoint laid out as the Checkpointer writes it."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2)).save_pretrained(base_dir)
    model = Qwen2ForCausalLM.from_pretrained(base_dir)  # its config names base_dir, as the trainer's does
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LoraLinear):
                mod.lora_B.weight.normal_(0, 0.1)
    step = root / "checkpoints" / "step-3"
    adapters = {k: v for k, v in model.state_dict().items() if is_adapter_param(k)}
    dcp.save({"model": adapters}, checkpoint_id=str(step / "actor"), no_dist=True)
    write_hf_metadata(model, build_tokenizer(), step / "hf" / "actor")
    (step / "meta.json").write_text("{}")  # what makes a step directory a complete checkpoint
    return step, base_dir, model


def test_adapter_export_is_pefts_format_and_merges_to_the_merged_export(
    lora_checkpoint: tuple[Path, Path, Qwen2ForCausalLM], tmp_path: Path
) -> None:
    step, base_dir, model = lora_checkpoint
    assert export_main([str(step), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert export_main([str(step), str(tmp_path / "merged")]) == 0

    config = adapter.read_config(tmp_path / "adapter")
    assert config is not None
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(base_dir)
    raw = load_file(str(tmp_path / "adapter" / adapter.WEIGHTS_FILE))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in raw
    assert raw["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert len(raw) == 2 * 3 * SMALL_QWEN2["num_hidden_layers"]

    tensors, cfg = adapter.read_adapter_dir(tmp_path / "adapter")
    remerged = merge_state_dict({**read_safetensors(base_dir), **tensors}, adapter.scale_of(cfg))
    exported = read_safetensors(tmp_path / "merged")
    assert exported.keys() == remerged.keys() - {"lm_head.weight"}  # tied: stored once
    for k, v in exported.items():
        torch.testing.assert_close(v, remerged[k], rtol=0, atol=0)

    ids = torch.randint(0, 64, (2, 9))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_adapter_export_of_a_full_checkpoint_is_refused(tmp_path: Path) -> None:
    step = tmp_path / "step-1"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL_QWEN2))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step / "actor"), no_dist=True)
    write_hf_metadata(model, build_tokenizer(), step / "hf" / "actor")
    with pytest.raises(ValueError, match="without --adapter"):
        export_checkpoint(step, tmp_path / "out", adapter_only=True)
