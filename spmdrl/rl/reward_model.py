"""A sequence-classification reward model (``*ForSequenceClassification``, num_labels=1): its files, how a
sample is rendered for it, and batched no-grad scoring on every rank (docs/rewards.md#reward-models).

Placement: colocated. Every rank holds the model sharded with FSDP2 over the actor's ranks (as the
reference model is) and scores its own samples; the memory per rank is the model over the world size,
where a replica on every rank would cost the whole model on each. The price is FSDP2's all-gathers
inside each forward, so every rank runs the same number of forwards (:meth:`RewardModel.score` pads a
rank with fewer micro-batches with a one-token forward whose score is dropped).

A sample is scored on the reward model's own chat template: the prompt's messages plus the response as
the assistant's turn, rendered by the reward model's tokenizer (which need not be the policy's). The
score is the head's output at the last token; a rendering longer than ``max_length`` keeps its end.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from spmdrl.data.prompts import encode
from spmdrl.models.build import ModelSpec, build_fsdp_model, resolve_dtype
from spmdrl.models.config import ModelConfig
from spmdrl.models.load import load_tokenizer
from spmdrl.models.parallelize import gathered_through, through_outputs
from spmdrl.rewards.config import RewardModelConfig
from spmdrl.rewards.reward_model_path import check_reward_model_dir

log = logging.getLogger("spmdrl")


def render_for_rm(tokenizer: Any, messages: list[dict[str, str]], response: str) -> str:
    """The conversation the reward model reads: the prompt's messages, then the response as the assistant's
    turn, in the reward model's chat template (no generation prompt: the turn is complete)."""
    return tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": response}], tokenize=False
    )


def encode_for_rm(
    tokenizer: Any, messages: list[list[dict[str, str]]], responses: list[str], max_length: int
) -> tuple[list[list[int]], int]:
    """Token ids of each rendered sample, each cut to its last ``max_length`` tokens (the score is read at
    the end); and how many were cut."""
    ids = [
        encode(tokenizer, render_for_rm(tokenizer, m, r)) for m, r in zip(messages, responses, strict=True)
    ]
    cut = sum(len(x) > max_length for x in ids)
    return [x[-max_length:] for x in ids], cut


def pad_right(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids_BT, attention_mask_BT)``, right-padded to the longest row."""
    width = max(len(r) for r in rows)
    ids_BT = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids_BT[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask_BT[i, : len(r)] = 1
    return ids_BT.to(device), mask_BT.to(device)


def sequence_scores(
    model: nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> torch.Tensor:
    """The head's output at each right-padded row's last real token, shape (B,), with the graph when grad
    is on (recipes/rm.py trains through it).

    transformers pools at the last token that is not ``pad_token_id``, which is wrong when the template's
    last token is the pad token (many tokenizers pad with their end-of-turn token); the per-token scores
    are taken from the head itself instead (its output, (B, T, 1), caught by a hook) and read at the
    attention mask's last position."""
    caught: list[torch.Tensor] = []
    handle = model.score.register_forward_hook(lambda _m, _i, out: caught.append(out))
    try:
        output = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
    finally:
        handle.remove()
    last_B = attention_mask_BT.sum(-1) - 1
    scores_B = caught[0][torch.arange(input_ids_BT.shape[0], device=input_ids_BT.device), last_B, 0].float()
    return through_outputs(scores_B, output)  # the hook's output, not the model's (see through_outputs)


class RewardModel:
    """The reward model on this rank: its FSDP2 module and tokenizer. Every rank of ``group`` calls
    :meth:`score` together."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        micro_batch_size: int,
        max_length: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.micro_batch_size, self.max_length = micro_batch_size, max_length
        self.device, self.group = device, group
        self.num_truncated = 0  # samples cut to max_length since the last take_truncated()

    @torch.no_grad()
    def score(self, messages: list[list[dict[str, str]]], responses: list[str]) -> torch.Tensor:
        """One float32 score per sample (on the CPU), in micro-batches of ``micro_batch_size``."""
        rows, cut = encode_for_rm(self.tokenizer, messages, responses, self.max_length)
        self.num_truncated += cut
        chunks = [rows[i : i + self.micro_batch_size] for i in range(0, len(rows), self.micro_batch_size)]
        # FSDP2 all-gathers inside every forward: each rank runs as many as the rank with the most.
        most = torch.tensor([len(chunks)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        pad_id = self.tokenizer.pad_token_id
        scores: list[torch.Tensor] = []
        with gathered_through(self.model):  # a whole-model unit: gathered once for all micro-batches
            for i in range(int(most.item())):
                chunk = chunks[i] if i < len(chunks) else [[pad_id]]  # a filler forward, its score dropped
                s_B = sequence_scores(self.model, *pad_right(chunk, pad_id, self.device))
                if i < len(chunks):
                    scores.append(s_B.cpu())
        return torch.cat(scores) if scores else torch.zeros(0)


def build_reward_model(
    rm: RewardModelConfig,
    model_cfg: ModelConfig,
    mesh: DeviceMesh,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> RewardModel:
    """reward_model.path as a frozen FSDP2 module on ``mesh`` (dtypes as model.*), with its own tokenizer.
    ``group``: the process group of ``mesh``'s ranks, which score together (None: the whole world)."""
    path = check_reward_model_dir(rm.path)
    spec = ModelSpec(
        path=path,
        param_dtype=resolve_dtype(model_cfg.param_dtype, device),
        reduce_dtype=resolve_dtype(model_cfg.reduce_dtype, device),
        trust_remote_code=model_cfg.trust_remote_code,
        train=False,
        head="reward",
    )
    model = build_fsdp_model(spec, mesh, device)
    tokenizer = load_tokenizer(path, model_cfg.trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id  # transformers' pooling refuses batches without one
    limit = getattr(model.config, "max_position_embeddings", None) or 2**31
    max_length = min(rm.max_length or limit, limit)
    log.info("reward model %s: micro-batch %d, max_length %d", path, rm.micro_batch_size_per_gpu, max_length)
    return RewardModel(
        model,
        tokenizer,
        micro_batch_size=rm.micro_batch_size_per_gpu,
        max_length=max_length,
        device=device,
        group=group,
    )
