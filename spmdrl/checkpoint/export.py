"""Model-only export in Hugging Face format (safetensors + config + tokenizer) that transformers loads back.

Written into a temporary sibling directory and renamed into place, so a crash mid-export never
leaves a half-written model where a user (or vLLM) would load it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

log = logging.getLogger(__name__)


def export_hf(
    model: nn.Module, tokenizer: object, out_dir: Path, *, dtype: torch.dtype | None = None
) -> None:
    """Gathers the full weights to rank 0 (CPU) and writes an HF model directory. Every rank must call it."""
    # Collective: every rank takes part in gathering the shards; only rank 0 receives them.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        config = model.config  # type: ignore[attr-defined]
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # stored once, as transformers does for tied weights
        tensors = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in state.items()}
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)  # type: ignore[attr-defined]
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        log.info("exported HF model to %s", out_dir)
    dist.barrier()
