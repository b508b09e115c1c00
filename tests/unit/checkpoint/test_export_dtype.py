"""The HF export's dtype (trainer.export_dtype, ``python -m spmdrl.export --dtype``): "auto" writes the
training dtype (model.param_dtype), "float32" the master weights, and config.json says which. A model built
by spmdrl (FSDP2 over 2 gloo ranks, bf16 params over float32 masters) is exported live (export_hf) and
from its sharded checkpoint (the converter, one process); both are read back from the safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spmdrl.checkpoint.export import TRAIN_DTYPE_FILE, read_train_dtype, resolve_export_dtype
from spmdrl.export import main as export_main
from spmdrl.testing.spawn import run_distributed


def _export_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from spmdrl.checkpoint.export import export_hf, write_hf_metadata
    from spmdrl.config import ModelConfig
    from spmdrl.models.build import build_fsdp_model, model_spec
    from spmdrl.models.tiny import build_tokenizer

    out, cpu = Path(root), torch.device("cpu")
    spec = model_spec(ModelConfig(param_dtype="bfloat16"), out / "base", cpu, train=True)
    model = build_fsdp_model(spec, init_device_mesh("cpu", (world,)), cpu)
    tokenizer = build_tokenizer()
    export_hf(model, tokenizer, out / "auto")
    export_hf(model, tokenizer, out / "float32", dtype="float32")
    # A checkpoint laid out as the Checkpointer writes it: the DCP shards and the HF metadata.
    step = out / "checkpoints" / "step-1"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(step / "actor"))
    if rank == 0:
        write_hf_metadata(model, tokenizer, step / "hf" / "actor")
        (step / "meta.json").write_text("{}")


def _read(out: Path) -> tuple[dict[str, torch.Tensor], str]:
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())["dtype"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    from spmdrl.models.build import read_safetensors
    from spmdrl.testing.models import save_small_qwen2

    root = tmp_path_factory.mktemp("export_dtype")
    save_small_qwen2(root / "base")
    run_distributed(_export_worker, 2, str(root), timeout_s=240)
    return root, read_safetensors(root / "base")


def test_live_export_writes_the_training_dtype_or_float32(exported: tuple[Path, dict]) -> None:
    root, base = exported
    auto, auto_dtype = _read(root / "auto")
    full, full_dtype = _read(root / "float32")
    assert (auto_dtype, full_dtype) == ("bfloat16", "float32")
    assert set(auto) == set(full) and {v.dtype for v in auto.values()} == {torch.bfloat16}
    assert {v.dtype for v in full.values()} == {torch.float32}
    for name, value in full.items():
        assert torch.equal(value, base[name]), name  # nothing trained: the master weights are the base's
        assert torch.equal(auto[name], value.to(torch.bfloat16)), name


def test_the_checkpoint_records_the_training_dtype_and_the_converter_follows_it(
    exported: tuple[Path, dict], tmp_path: Path
) -> None:
    root, base = exported
    step = root / "checkpoints" / "step-1"
    assert json.loads((step / "hf" / "actor" / TRAIN_DTYPE_FILE).read_text()) == {"param_dtype": "bfloat16"}
    assert export_main([str(step), str(tmp_path / "auto")]) == 0
    assert export_main([str(step), str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    auto, auto_dtype = _read(tmp_path / "auto")
    full, full_dtype = _read(tmp_path / "f32")
    assert (auto_dtype, full_dtype) == ("bfloat16", "float32")
    live, _ = _read(root / "auto")
    for name, value in full.items():
        assert torch.equal(value, base[name]), name
        assert torch.equal(auto[name], live[name]), name  # the converter's auto is the run's own export


def test_auto_resolution(tmp_path: Path) -> None:
    """auto: the training dtype, float32 for a merged LoRA model and for a checkpoint that predates the
    record; a named dtype wins; a bad name says what is allowed."""
    assert resolve_export_dtype("auto", torch.bfloat16, lora=False) == torch.bfloat16
    assert resolve_export_dtype("auto", torch.bfloat16, lora=True) == torch.float32
    assert resolve_export_dtype("float16", torch.float32, lora=True) == torch.float16
    assert read_train_dtype(tmp_path) == torch.float32
    with pytest.raises(ValueError, match="export dtype must be one of"):
        resolve_export_dtype("fp8", torch.float32, lora=False)
