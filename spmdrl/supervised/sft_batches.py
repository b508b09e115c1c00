"""The SFT stage's data and loss: the dataset of (prompt, response) rows, micro-batches right-padded to
their longest sequence, and the masked cross-entropy on response tokens."""

from __future__ import annotations

import torch

from spmdrl.algos.losses import masked_cross_entropy
from spmdrl.data.reasoning_gym_task import ReasoningGymConfig
from spmdrl.data.sft import SFTBatch, SFTDataset, collate_sft
from spmdrl.data.sources import read_options
from spmdrl.data.tiny_shapes_task import TinyShapesConfig
from spmdrl.data.tiny_task import TinyTaskConfig, resolve_data_files
from spmdrl.data.tools_task import ToolsTaskConfig
from spmdrl.models.forward import model_dtype
from spmdrl.rollout.rollout import load_multi_turn_tools
from spmdrl.runtime import Run
from spmdrl.tools import tool_schemas


def load_sft_dataset(
    run: Run,
    tokenizer: object,
    files: list[str],
    *,
    key: str = "data.train_files",
    processor: object | None = None,
) -> SFTDataset:
    """The pairs of ``files``, the config's ``key`` (its split: data.train_split or data.val_split)."""
    d = run.cfg.data
    return SFTDataset(
        resolve_data_files(
            files,
            run.cache_dir,
            run.cfg.section(TinyTaskConfig),
            run.cfg.section(ToolsTaskConfig),
            run.cfg.section(ReasoningGymConfig),
            run.cfg.section(TinyShapesConfig),
        ),
        tokenizer,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        max_prompt_length=d.max_prompt_length,
        max_response_length=d.max_response_length,
        overlong=d.overlong,
        options=read_options(d, key),
        tools=tool_schemas(load_multi_turn_tools(run.cfg)) if run.cfg.rollout.multi_turn.enable else None,
        processor=processor,
    )


def micro_batches(examples: list, size: int, pad_id: int, device: torch.device) -> list[SFTBatch]:
    out = []
    for i in range(0, len(examples), size):
        out.append(collate_sft(examples[i : i + size], pad_id).to(device))
    return out


def num_target_tokens(batch: SFTBatch) -> int:
    # Position t+1 is a target iff loss_mask[t+1] == 1 (logits[:, t] predict input_ids[:, t+1]).
    return int(batch.loss_mask_BT[:, 1:].sum())


def forward_loss(model: torch.nn.Module, batch: SFTBatch, global_tokens: float) -> torch.Tensor:
    images = batch.images.model_kwargs(batch.input_ids_BT.device, model_dtype(model)) if batch.images else {}
    logits = model(
        input_ids=batch.input_ids_BT,
        attention_mask=batch.attention_mask_BT,
        position_ids=batch.position_ids_BT,
        **images,
    ).logits
    loss, _ = masked_cross_entropy(
        logits, batch.input_ids_BT, batch.loss_mask_BT, num_global_tokens=global_tokens
    )
    return loss
