"""Greedy completions from a trainer-side (FSDP2) model: a few samples without an engine (SFT's validation).

RL recipes generate with the in-process vLLM engine; SFT has none, and a handful of greedy completions at
each validation is cheap enough on the trainer's own model.
"""

from __future__ import annotations

import torch

from spmdrl.data.vision import ImageInputs


@torch.no_grad()
def greedy_completions(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    pad_id: int,
    device: torch.device,
    synced: bool,
    images: ImageInputs | None = None,
) -> list[list[int]]:
    """The greedy continuation of each prompt (token ids, up to ``max_new_tokens``, padding after an eos
    included as ``pad_id``).

    ``synced``: under FSDP2 every rank must call this with the same number of prompts. Each forward gathers
    the layers' weights from all ranks, so the ranks must run the same forwards; ``synced_gpus`` keeps them
    in step until every rank is done. ``images``: a vision-language model's images of the prompts, in order."""
    width = max(len(p) for p in prompts)
    # Left-padded, so every row's completion starts at the same column.
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    was_training = model.training
    model.eval()
    out = model.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        synced_gpus=synced,
        **(images.model_kwargs(device, torch.float32) if images is not None else {}),
    )
    model.train(was_training)
    return [row[width:].tolist() for row in out]
