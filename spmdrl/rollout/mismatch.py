"""Trainer-vs-engine logprob parity: the trainer rescoring the engine's samples, and the gap between them.

The engine samples in bf16 with its own kernels; the trainer scores the same tokens in its own precision.
A small gap is expected. A large one means the weight sync is broken (stale or misnamed weights) or the
two disagree on the sampling distribution (temperature), and it biases the policy gradient; recipes log
these numbers every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from spmdrl.algos.kl import kl_penalty
from spmdrl.algos.losses import token_logprobs
from spmdrl.rollout.engine import Generation


@dataclass(frozen=True)
class ResponseBatch:
    """Prompt + response rows, right-padded. ``response_mask_BT`` marks the sampled tokens;
    ``engine_logprobs_BT`` holds the engine's logprob of each, at the token's own position."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    engine_logprobs_BT: torch.Tensor


def pack_generations(
    prompts: Sequence[list[int]], generations: Sequence[Generation], pad_id: int
) -> ResponseBatch:
    """One row per generation: its prompt (``prompts[g.prompt_index]``) followed by its sampled tokens."""
    rows = [list(prompts[g.prompt_index]) + list(g.token_ids) for g in generations]
    T = max((len(r) for r in rows), default=0)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    response = torch.zeros((B, T), dtype=torch.bool)
    engine_lp = torch.zeros((B, T), dtype=torch.float32)
    for i, (row, g) in enumerate(zip(rows, generations, strict=True)):
        if len(g.logprobs) != len(g.token_ids):
            raise ValueError(
                f"generation {i} has {len(g.token_ids)} tokens but {len(g.logprobs)} logprobs "
                "(generate with SamplingSpec.logprobs=True)"
            )
        start = len(row) - len(g.token_ids)
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        response[i, start : len(row)] = True
        engine_lp[i, start : len(row)] = torch.tensor(g.logprobs, dtype=torch.float32)
    return ResponseBatch(input_ids, attention, response, engine_lp)


@torch.no_grad()
def score_tokens(
    model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The model's logprob of each token given the ones before it, (B, T) float32; position 0 is 0.

    Logits are divided by ``temperature`` (the engine reports logprobs after temperature); greedy
    (0) is scored at 1. With top-k / top-p the engine's logprobs are of the truncated, renormalized
    distribution, which this does not reproduce: compare the two only without truncation.
    """
    logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits
    if temperature > 0:
        logits_BTV = logits_BTV / temperature
    out_BT = torch.zeros(input_ids_BT.shape, dtype=torch.float32, device=input_ids_BT.device)
    out_BT[:, 1:] = token_logprobs(logits_BTV[:, :-1], input_ids_BT[:, 1:])
    return out_BT


def logprob_mismatch(
    trainer_logprobs_BT: torch.Tensor,
    engine_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Mean / max |trainer - engine| logprob and the k3 estimate of KL(engine || trainer) over masked tokens.

    Samples come from the engine, so with ``d = trainer - engine`` the k3 estimator ``exp(d) - d - 1`` is
    unbiased for KL(engine || trainer) and never negative. Local to this rank unless ``group`` is given
    (``dist.group.WORLD`` for all ranks): then they cover every rank's tokens, and every rank must call.
    """
    mask = mask_BT.bool()
    diff = (trainer_logprobs_BT.float() - engine_logprobs_BT.float()).abs()[mask]
    k3 = kl_penalty(engine_logprobs_BT.float(), trainer_logprobs_BT.float(), "k3")[mask]
    sums = torch.stack([diff.sum(), k3.sum(), diff.new_tensor(float(diff.numel()))]).double()
    peak = diff.max() if diff.numel() else diff.new_tensor(0.0)
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    count = max(float(sums[2]), 1.0)
    return {
        "logprob_abs_diff_mean": float(sums[0]) / count,
        "logprob_abs_diff_max": float(peak),
        "kl_k3": float(sums[1]) / count,
        "tokens": float(sums[2]),
    }
