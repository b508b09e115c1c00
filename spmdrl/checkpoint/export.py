"""Model-only export in Hugging Face format (safetensors + config + tokenizer + generation config).

Two ways in, one writer (:func:`write_hf_dir`):

- :func:`export_hf`: the live FSDP2 model at the end of a run (every rank of its group calls it);
- :func:`export_checkpoint` (``python -m spmdrl.export <checkpoint> <out_dir>``): a sharded DCP
  checkpoint, on one process, no process group, whatever world size saved it.

The weights are written by ``huggingface_hub.save_torch_state_dict``, the Hub's layout: one
``model.safetensors``, or above ``max_shard_size`` (5 GB, huggingface_hub's default) numbered shards
``model-0000k-of-0000n.safetensors`` with a ``model.safetensors.index.json`` that maps each tensor to
its shard, which transformers and vLLM both read.

The weights are written in the training dtype by default (``trainer.export_dtype=auto``; ``--dtype auto``
of ``python -m spmdrl.export``): ``model.param_dtype``, bf16 on CUDA and float32 on CPU, rather than the
float32 master copy the trainer keeps; float32 (or another dtype) on request. A LoRA model is merged in
float32 and written so under ``auto`` (bf16 would round most of a small adapter delta away). config.json's
``dtype`` says what was written.

Written into a temporary sibling directory and renamed into place, so a crash mid-export never
leaves a half-written model where a user (or vLLM) would load it. The weight files get the mode any
other new file gets under the process's umask (0644 under the usual 022), so other accounts can load
the export: safetensors 0.8 writes through a private temporary file and leaves them 0600
(https://github.com/safetensors/safetensors/issues/782).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import save_torch_state_dict
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from spmdrl.checkpoint import adapter
from spmdrl.distributed.env import wait_for
from spmdrl.models.build import DTYPES, read_safetensors
from spmdrl.models.experts import to_checkpoint_layout
from spmdrl.models.lora import is_adapter_param, lora_scale, merge_state_dict

log = logging.getLogger(__name__)

# trainer.export_dtype / --dtype: "auto" is the training dtype (resolve_export_dtype).
EXPORT_DTYPES = ("auto", *DTYPES)
# In a checkpoint's hf/<role>/: the dtype the model was trained in, for the converter's "auto".
TRAIN_DTYPE_FILE = "train_dtype.json"
# Set on a model by spmdrl.models.build: its resolved model.param_dtype.
TRAIN_DTYPE_ATTR = "spmdrl_param_dtype"


def train_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model`` computes in (``model.param_dtype`` as its build resolved it); float32 for a model
    spmdrl did not build."""
    return getattr(model, TRAIN_DTYPE_ATTR, torch.float32)


def resolve_export_dtype(name: str, trained_in: torch.dtype, *, lora: bool) -> torch.dtype:
    """The dtype an export writes: ``name`` itself, or for "auto" the training dtype, except a LoRA model's
    (merged in float32 and written so: rounding W + scale * B A to bf16 would wipe out most of a small
    adapter delta)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {name!r}")
        return DTYPES[name]
    return torch.float32 if lora else trained_in


def _write_train_dtype(dtype: torch.dtype, out_dir: Path) -> None:
    name = str(dtype).removeprefix("torch.")
    (out_dir / TRAIN_DTYPE_FILE).write_text(json.dumps({"param_dtype": name}) + "\n")


def read_train_dtype(meta_dir: Path) -> torch.dtype:
    """The training dtype a checkpoint's ``hf/<role>/`` records; float32 for one written before it was
    recorded (whose export was float32 then)."""
    f = meta_dir / TRAIN_DTYPE_FILE
    if not f.is_file():
        return torch.float32
    name = json.loads(f.read_text())["param_dtype"]
    if name not in DTYPES:
        raise ValueError(f"{f}: param_dtype {name!r} is not one of {tuple(DTYPES)}")
    return DTYPES[name]


def write_hf_dir(
    tensors: dict[str, torch.Tensor],
    config: object,
    out_dir: Path,
    *,
    tokenizer: object | None = None,
    generation_config: object | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """An HF model directory from full tensors, atomically (temporary sibling, then one rename).

    ``max_shard_size`` (bytes, or a string such as ``"500MB"``) splits the weights into shards with an
    index when they are larger; a tensor larger than it gets a shard of its own. ``dtype`` casts the floating
    tensors (None: as given); config.json's ``dtype`` is set to what is written. A mixture-of-experts
    model's fused experts are written as the checkpoint layout's per-expert matrices (spmdrl.models.experts),
    which transformers and vLLM load."""
    tensors = to_checkpoint_layout(tensors)
    if getattr(config, "tie_word_embeddings", False):
        tensors = {
            k: v for k, v in tensors.items() if k != "lm_head.weight"
        }  # stored once, as transformers does
    tensors = {
        k: _own_storage((v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu())
        for k, v in tensors.items()
    }
    if dtype is None:
        dtype = next((v.dtype for v in tensors.values() if v.is_floating_point()), None)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_torch_state_dict(tensors, tmp, max_shard_size=max_shard_size)
    # The directory was just made with 0o777 & ~umask: a plain new file's mode is that without the x bits.
    file_mode = tmp.stat().st_mode & 0o666
    for f in tmp.glob("*.safetensors"):
        f.chmod(file_mode)
    if dtype is not None:
        config.dtype = dtype  # type: ignore[attr-defined]
    config.save_pretrained(tmp)  # type: ignore[attr-defined]
    if generation_config is not None:
        generation_config.save_pretrained(tmp)  # type: ignore[attr-defined]
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    log.info("exported HF model to %s", out_dir)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied if it is a view of a larger buffer: safetensors refuses those, and a gathered tensor
    whose rows do not split evenly over the ranks is one (the padding rows of the gather buffer)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def write_hf_metadata(model: nn.Module, tokenizer: object, out_dir: Path) -> None:
    """Config, generation config and tokenizer, without weights: what a checkpoint keeps for export. A LoRA
    model's also gets its adapter_config.json, which names the base model its adapters apply to, and the
    dtype its base is stored in. Every model's gets its training dtype (TRAIN_DTYPE_FILE), which the
    converter's ``--dtype auto`` writes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)  # type: ignore[attr-defined]
    _write_train_dtype(train_dtype(model), out_dir)
    lora = adapter.model_adapter_config(model)
    if lora is not None:
        adapter.write_config(lora, out_dir)
        adapter.write_base_dtype(adapter.base_dtype(model), out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # type: ignore[attr-defined]


def export_hf(
    model: nn.Module,
    tokenizer: object,
    out_dir: Path,
    *,
    dtype: str = "auto",
    group: dist.ProcessGroup | None = None,
) -> None:
    """Gathers the full weights to the group's first rank (CPU) and writes an HF model directory.

    Every rank of ``group`` (the ranks the model is sharded over; None: the world) must call it. A LoRA
    model is written merged (W + alpha/r B A): the base model's architecture and names. ``dtype``: one of
    EXPORT_DTYPES (trainer.export_dtype; resolve_export_dtype).
    """
    # Collective: every rank takes part in gathering the shards. With cpu_offload only *global* rank 0
    # receives them (torch's rule); a group without it (the critic's ranks under a split placement)
    # gathers to every member instead and the first one writes.
    offload = group is None or dist.get_global_rank(group, 0) == 0
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    writer = dist.get_rank(group) == 0
    scale = lora_scale(model)
    written = resolve_export_dtype(dtype, train_dtype(model), lora=scale is not None)
    if writer:
        if scale is not None:
            # LoRA: the frozen base is stored in param_dtype (bf16 on CUDA); merged in float32 and written
            # so, or rounding W + scale * B A back to bf16 would wipe out most of a small adapter delta.
            state = merge_state_dict(
                {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, scale
            )
        write_hf_dir(
            state,
            model.config,  # type: ignore[attr-defined]
            out_dir,
            tokenizer=tokenizer,
            generation_config=getattr(model, "generation_config", None),
            dtype=written,
        )
        log.info("HF export in %s (trainer.export_dtype=%s)", str(written).removeprefix("torch."), dtype)
    # Writing a large model to slow storage must not count against the collective timeout.
    wait_for(f"export:{out_dir}", writer=writer)


def export_checkpoint(
    checkpoint: Path,
    out_dir: Path,
    *,
    role: str = "actor",
    dtype: str = "auto",
    adapter_only: bool = False,
) -> None:
    """A sharded checkpoint's ``role`` model as an HF directory, on one process (no process group).

    A LoRA run's checkpoint holds the adapters only: they are merged into the base model its
    ``adapter_config.json`` names, or with ``adapter_only`` written alone in PEFT's format. ``dtype``: as
    export_hf's, "auto" being the training dtype the checkpoint records."""
    import torch.distributed.checkpoint as dcp
    from transformers import (
        AutoConfig,
        AutoModelForTokenClassification,
        AutoProcessor,
        AutoTokenizer,
        GenerationConfig,
    )

    from spmdrl.models.build import causal_lm_class

    meta_dir = checkpoint / "hf" / role
    if not (checkpoint / role).is_dir() or not meta_dir.is_dir():
        have = sorted(p.name for p in (checkpoint / "hf").iterdir()) if (checkpoint / "hf").is_dir() else []
        raise FileNotFoundError(
            f"{checkpoint} has no '{role}' model to export (it has: {have or 'none'}); pass a step-<N> "
            "directory of a run's checkpoints/ and --role actor or critic"
        )
    config = AutoConfig.from_pretrained(meta_dir)
    lora = adapter.read_config(meta_dir)
    if adapter_only and lora is None:
        raise ValueError(
            f"{checkpoint}: its {role} trained every weight (no LoRA adapters, model.lora.rank=0); "
            "export it without --adapter"
        )
    if lora is not None:
        adapters = _load_adapters(checkpoint / role)
        if adapter_only:
            adapter.write_adapter_dir(adapters, lora, out_dir)
            log.info("exported the LoRA adapter to %s", out_dir)
            return
        base = Path(lora["base_model_name_or_path"])
        if not (base / "config.json").is_file():
            raise FileNotFoundError(
                f"{checkpoint} holds LoRA adapters of the base model {base} (model.path), which is not there "
                "any more; restore it, or export the adapter alone with --adapter"
            )
        # The run trained the adapters on the base rounded to the dtype it stored it in (bf16 on CUDA) and
        # its own export merged into that: round the same way, so both exports are the same model.
        stored = adapter.read_base_dtype(meta_dir) or torch.float32
        base_state = {
            k: v.to(stored).float() if v.is_floating_point() else v for k, v in read_safetensors(base).items()
        }
        state = merge_state_dict({**base_state, **adapters}, adapter.scale_of(lora))
    else:
        auto = AutoModelForTokenClassification if role == "critic" else causal_lm_class(config)
        with torch.device("meta"):
            model = auto.from_config(config, dtype=torch.float32)
        # The checkpoint's keys are the model's own (get_state_dict strips the FSDP / checkpointing wrappers).
        state = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        dcp.load({"model": state}, checkpoint_id=str(checkpoint / role), no_dist=True)
    gen = (
        GenerationConfig.from_pretrained(meta_dir)
        if (meta_dir / "generation_config.json").is_file()
        else None
    )
    write_hf_dir(
        state,
        config,
        out_dir,
        # A vision-language model's processor (its tokenizer and image processor), else the tokenizer.
        tokenizer=(
            AutoProcessor if (meta_dir / "processor_config.json").is_file() else AutoTokenizer
        ).from_pretrained(meta_dir),
        generation_config=gen,
        dtype=resolve_export_dtype(dtype, read_train_dtype(meta_dir), lora=lora is not None),
    )


def _load_adapters(dcp_dir: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a LoRA checkpoint's DCP state, full, by trainer name (its keys and shapes
    come from the checkpoint's own metadata: no model needs to be built)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    state = {
        k.removeprefix("model."): torch.empty(tuple(m.size), dtype=torch.float32)  # type: ignore[union-attr]
        for k, m in metadata.items()
        if k.startswith("model.") and is_adapter_param(k)
    }
    dcp.load({"model": state}, checkpoint_id=str(dcp_dir), no_dist=True)
    return state
