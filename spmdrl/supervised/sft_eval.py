"""The SFT stage's validation: the loss on the whole held-out split, and greedy samples of its first prompts
scored by exact match with the reference response."""

from __future__ import annotations

import dataclasses
import math

import torch

from spmdrl.data.sft import SFTDataset
from spmdrl.data.vision import ImageInputs
from spmdrl.distributed.reduce import all_reduce_sum
from spmdrl.logging.samples import Sample
from spmdrl.models.generate import greedy_completions
from spmdrl.runtime import Run
from spmdrl.supervised.sft_batches import forward_loss, micro_batches, num_target_tokens


@torch.no_grad()
def validation_loss(run: Run, model: torch.nn.Module, ds: SFTDataset, micro: int, pad_id: int) -> float:
    """Mean NLL per response token over the whole validation set, all ranks together.

    FSDP2 runs collectives inside forward, so every rank must run the same number of forwards:
    ranks with a shorter shard repeat an item whose loss is then dropped (weight 0).
    """
    env = run.env
    mine = list(range(env.rank, len(ds), env.world_size))
    per_rank = math.ceil(len(ds) / env.world_size)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine += [0] * (per_rank - len(mine))
    model.eval()
    nll_sum, tokens = 0.0, 0
    for i in range(0, per_rank, micro):
        idx, w = mine[i : i + micro], weights[i : i + micro]
        batch = micro_batches([ds[j] for j in idx], micro, pad_id, env.device)[0]
        keep = torch.tensor(w, device=env.device).unsqueeze(1)
        batch = dataclasses.replace(
            batch, loss_mask_BT=batch.loss_mask_BT * keep.to(batch.loss_mask_BT.dtype)
        )
        n = num_target_tokens(batch)
        nll_sum += float(forward_loss(model, batch, global_tokens=1.0))  # a plain sum
        tokens += n
    model.train()
    totals = all_reduce_sum({"nll": nll_sum, "tokens": tokens}, env.device)
    return totals["nll"] / max(totals["tokens"], 1.0)


@torch.no_grad()
def generate_samples(
    run: Run, model: torch.nn.Module, tokenizer: object, ds: SFTDataset, step: int
) -> list[Sample]:
    """Greedy completions of the first logging.samples_per_log validation prompts, each with its reference
    response and ``reward`` 1.0 where the completion equals it exactly (val/exact_match). Every rank
    generates the same prompts (FSDP2 needs the same forwards on every rank)."""
    decode = tokenizer.decode  # type: ignore[attr-defined]
    examples = [ds[i] for i in range(min(run.cfg.logging.samples_per_log, len(ds)))]
    if not examples:
        return []
    starts = [ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.input_ids) for ex in examples]
    prompts = [ex.input_ids[:start] for ex, start in zip(examples, starts, strict=True)]
    completions = greedy_completions(
        model,
        prompts,
        max_new_tokens=run.cfg.data.max_response_length,
        pad_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        device=run.env.device,
        synced=run.env.world_size > 1,
        images=ImageInputs.cat([ex.images for ex in examples]) if examples[0].images is not None else None,
    )
    samples = []
    for ex, start, prompt, completion in zip(examples, starts, prompts, completions, strict=True):
        response = decode(completion, skip_special_tokens=True)
        reference = decode(ex.input_ids[start:], skip_special_tokens=True)
        exact = float(response.strip() == reference.strip())
        samples.append(
            Sample(step, "val", decode(prompt, skip_special_tokens=True), response, reference, exact, "sft")
        )
    return samples
