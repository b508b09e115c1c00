"""LoRA adapters in PEFT's format, so ``peft.PeftModel.from_pretrained(base, out_dir)`` loads them.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``base_model_name_or_path``, ...) and ``adapter_model.safetensors``, whose keys are PEFT's:
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` for the trainer's
``<module>.lora_A.weight`` / ``lora_B.weight`` (spmdrl.models.lora). A LoRA run's checkpoint keeps the
same ``adapter_config.json`` next to its config (``hf/actor/``): it names the base model the checkpoint's
adapters apply to, which its DCP state does not hold; and ``lora_base.json``, the dtype the run stored that
base in (``model.param_dtype``: bf16 on CUDA), so that an export from the checkpoint merges into the base the
adapters were trained on, as the run's own end-of-run export does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from spmdrl.models.lora import LoraLinear, adapter_module_names, is_adapter_param

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BASE_FILE = "lora_base.json"
PEFT_PREFIX = "base_model.model."


def adapter_config(
    *, rank: int, alpha: float, dropout: float, target_modules: list[str], base_model: str
) -> dict[str, Any]:
    """PEFT's LoraConfig fields for adapters spmdrl trains (plain LoRA: no DoRA, rsLoRA or bias)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target_modules,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def model_adapter_config(model: nn.Module) -> dict[str, Any] | None:
    """The adapter config of a LoRA model (its base: the directory its config was read from), or None."""
    layer = next((m for m in model.modules() if isinstance(m, LoraLinear)), None)
    if layer is None:
        return None
    rank = layer.lora_A.out_features
    dropout = layer.dropout.p if isinstance(layer.dropout, nn.Dropout) else 0.0
    names = [n for n, _ in model.named_parameters() if is_adapter_param(n)]
    return adapter_config(
        rank=rank,
        alpha=layer.scale * rank,
        dropout=dropout,
        target_modules=adapter_module_names(names),
        base_model=str(model.config.name_or_path),  # type: ignore[attr-defined]
    )


def base_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a LoRA model stores its frozen base in (spmdrl.models.build: ``model.param_dtype``)."""
    return next(p.dtype for n, p in model.named_parameters() if not is_adapter_param(n))


def write_base_dtype(dtype: torch.dtype, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / BASE_FILE).write_text(json.dumps({"base_dtype": str(dtype).removeprefix("torch.")}) + "\n")


def read_base_dtype(path: Path) -> torch.dtype | None:
    """The base's stored dtype a checkpoint's ``hf/<role>/`` records; None for a checkpoint written before
    it was recorded (its base was float32 then)."""
    f = path / BASE_FILE
    if not f.is_file():
        return None
    name = json.loads(f.read_text())["base_dtype"]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{f}: base_dtype {name!r} is not a torch dtype")
    return dtype


def read_config(path: Path) -> dict[str, Any] | None:
    """``path``'s adapter_config.json, or None when there is none."""
    f = path / CONFIG_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def scale_of(config: dict[str, Any]) -> float:
    return float(config["lora_alpha"]) / int(config["r"])


def write_config(config: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def write_adapter_dir(adapters: dict[str, torch.Tensor], config: dict[str, Any], out_dir: Path) -> None:
    """A PEFT adapter directory from the trainer's adapter tensors (full, by trainer name), atomically."""
    tensors = {
        PEFT_PREFIX + k: v.detach().cpu().contiguous().clone()
        for k, v in adapters.items()
        if is_adapter_param(k)
    }
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_config(config, tmp)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def read_adapter_dir(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter tensors by trainer name, adapter config) of a PEFT adapter directory."""
    config = read_config(path)
    if config is None:
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}: not a LoRA adapter directory")
    tensors = load_file(str(path / WEIGHTS_FILE))
    return {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}, config
