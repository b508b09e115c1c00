"""SFT datasets: (prompt, response) pairs tokenized with an exact prompt/response boundary, and collation.

The text of one example is the chat-templated prompt (ending with the assistant's generation prompt),
then the response, then the token the chat template ends an assistant turn with (the tokenizer's eos,
or Llama 3's ``<|eot_id|>`` / Gemma's ``<end_of_turn>`` where the template ends turns with another token:
spmdrl.data.turns.end_of_turn_ids, the token rollouts stop on). The prompt and the response are tokenized apart and
concatenated, so the loss mask marks exactly the response tokens; tokenizing the joined string could
merge tokens across the boundary. As for RL prompts (see spmdrl.data.prompts), every rank computes all
lengths for the overlong filter and builds examples lazily.

A multi-turn response (messages with ``tool`` turns, a tool-calling demonstration) becomes the ids a
multi-turn rollout builds (spmdrl.rollout.agent_loop): each assistant message's content and the eos
token (loss mask 1), and between them each run of other messages as the observation ids of
:class:`spmdrl.data.turns.TurnCodec` (loss mask 0), the same codec the rollout uses.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spmdrl.data import images
from spmdrl.data.images import image_prompt
from spmdrl.data.parquet import DataError, to_messages
from spmdrl.data.prompts import (
    check_overlong,
    encode,
    fits,
    iter_row_chunks,
    no_rows_left,
    render_prompt,
    token_lengths,
)
from spmdrl.data.sources import ReadOptions, read_sources
from spmdrl.data.turns import TemplateError, TurnCodec, end_of_turn_ids
from spmdrl.data.vision import ImageInputs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from spmdrl.data.vision import ImagePrompt

_CACHE_ITEMS = 16384

# One piece of a response: an assistant message's content (trained on, followed by eos), or a run of
# other messages between two assistant messages (tool results: observation tokens, not trained on).
Part = str | list[dict[str, str]]


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    # 1 for response tokens (the final eos included), 0 for prompt tokens.
    loss_mask: list[int]
    # A vision-language model's images of the prompt (spmdrl.data.vision), None for a text model.
    images: ImageInputs | None = None


@dataclass
class SFTBatch:
    """Right-padded batch. logits[:, t] predicts input_ids[:, t + 1]; it counts iff loss_mask_BT[:, t + 1]."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    position_ids_BT: torch.Tensor
    # The rows' images in row order (moved to the device by the forward), None for a text model.
    images: ImageInputs | None = None

    def to(self, device: torch.device | str) -> SFTBatch:
        return SFTBatch(
            input_ids_BT=self.input_ids_BT.to(device),
            attention_mask_BT=self.attention_mask_BT.to(device),
            loss_mask_BT=self.loss_mask_BT.to(device),
            position_ids_BT=self.position_ids_BT.to(device),
            images=self.images,
        )


class SFTDataset:
    """(prompt, response) pairs from parquet; ``num_filtered`` counts pairs dropped as too long.

    The prompt column holds chat messages or a plain string (one user message). The response column
    holds a string, or messages whose last is the assistant's answer; earlier ones extend the prompt.
    Messages with a ``tool`` turn among them are a multi-turn demonstration instead: every assistant
    message is trained on, the tool (and any other) messages between them are observation tokens
    (loss mask 0), and the first and last message must be the assistant's. The response limit counts
    the response tokens (observations included) and the eos tokens.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_key: str,
        response_key: str,
        max_prompt_length: int,
        max_response_length: int,
        overlong: str,
        tools: list[dict[str, Any]] | None = None,
        options: ReadOptions | None = None,
        processor: Any | None = None,
    ) -> None:
        check_overlong(overlong)
        # A vision-language model's processor: prompts may carry images (spmdrl.data.images).
        self.processor = processor
        # The tool schemas RL prompts are rendered with (rollout.multi_turn), so a warm-start sees the
        # same prompts (a real model's template describes the tools in its system turn).
        self.tools = tools
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos token; SFT appends one after each response")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.response_key = response_key
        self.eos_id = int(tokenizer.eos_token_id)
        # A single-turn demonstration ends where the chat template ends an assistant turn, the token the
        # engine stops rollouts on: Llama 3's <|eot_id|> or Gemma's <end_of_turn> where they differ from
        # the eos (a warm-start that taught the eos would teach a token the template never writes there).
        self.response_end_id = (end_of_turn_ids(tokenizer) or [self.eos_id])[0]
        self._codec: TurnCodec | None = None  # built on the first multi-turn row
        self.source = read_sources(
            paths,
            [prompt_key, response_key],
            optional_columns=[images.IMAGES_COLUMN] if processor is not None else [],
            column_keys={prompt_key: "data.prompt_key", response_key: "data.response_key"},
            options=options,
        )
        kept: list[int] = []
        for start, rows in iter_row_chunks(self.source):
            pairs = [self._parse(start + j, row) for j, row in enumerate(rows)]
            if processor is not None:  # expanded image tokens count: each image decoded and checked now
                prompt_lens = [
                    len(self._image_prompt(start + j, row, p).token_ids)
                    for j, (row, (p, _)) in enumerate(zip(rows, pairs, strict=True))
                ]
            else:
                prompt_lens = token_lengths(tokenizer, [p for p, _ in pairs])
            response_lens = self._response_lengths([r for _, r in pairs])
            for j, (n_prompt, n_response) in enumerate(zip(prompt_lens, response_lens, strict=True)):
                where = self.source.where(start + j)
                ok = fits(
                    n_prompt,
                    max_prompt_length,
                    what="chat-templated prompt",
                    key="data.max_prompt_length",
                    where=where,
                    overlong=overlong,
                )
                ok = ok and fits(
                    n_response,
                    max_response_length,
                    what="response (with eos)",
                    key="data.max_response_length",
                    where=where,
                    overlong=overlong,
                )
                if ok:
                    kept.append(start + j)
        if not kept:
            raise no_rows_left(self.source, "data.max_prompt_length / data.max_response_length")
        self._rows = np.asarray(kept, dtype=np.int64)
        self.num_filtered = self.source.table.num_rows - len(kept)
        self._build_cached = functools.lru_cache(maxsize=_CACHE_ITEMS)(self._build)

    def _parse(self, row: int, cells: dict[str, Any]) -> tuple[str, list[Part]]:
        """(templated prompt text, response parts) of one row; see :data:`Part`."""
        where = self.source.where(row)
        messages = to_messages(
            cells[self.prompt_key], where=where, column=self.prompt_key, key="data.prompt_key"
        )
        if self.processor is not None:
            images.check_count(
                cells.get(images.IMAGES_COLUMN), images.count_placeholders(messages), where=where
            )
        response = cells[self.response_key]
        if isinstance(response, str):
            return render_prompt(
                self.tokenizer, self._template_messages(messages), where=where, tools=self.tools
            ), [response]
        turns = to_messages(response, where=where, column=self.response_key, key="data.response_key")
        if turns[-1]["role"] != "assistant":
            raise DataError(
                f"{where}: the last message in column {self.response_key!r} has role "
                f"{turns[-1]['role']!r}; it must be the assistant's answer"
            )
        if not any(m["role"] == "tool" for m in turns):
            # Earlier messages extend the prompt; only the last is trained on.
            messages = messages + turns[:-1]
            return render_prompt(
                self.tokenizer, self._template_messages(messages), where=where, tools=self.tools
            ), [turns[-1]["content"]]
        if turns[0]["role"] != "assistant":
            raise DataError(
                f"{where}: column {self.response_key!r} holds a multi-turn response (it has tool messages) "
                f"whose first message has role {turns[0]['role']!r}; it must be the assistant's first turn"
            )
        parts: list[Part] = []
        for m in turns:
            if m["role"] == "assistant":
                parts.append(m["content"])
            elif isinstance(parts[-1], str):
                parts.append([m])
            else:
                parts[-1].append(m)
        return render_prompt(
            self.tokenizer, self._template_messages(messages), where=where, tools=self.tools
        ), parts

    def _template_messages(self, messages: list[dict[str, str]]) -> list[dict[str, Any]]:
        """A VLM's template reads images as parts of a message's content (images.as_parts)."""
        return images.as_parts(messages) if self.processor is not None else messages  # type: ignore[return-value]

    def _turn_end_id(self) -> int:
        return self._turn_codec().turn_end_id

    def _observation_ids(self, messages: list[dict[str, str]]) -> list[int]:
        codec = self._turn_codec()
        try:
            return codec.observation_ids(messages)
        except TemplateError as e:
            raise DataError(f"multi-turn SFT responses need a chat template for tool turns: {e}") from e

    def _turn_codec(self) -> TurnCodec:
        """The codec, built on the first multi-turn row."""
        if self._codec is None:
            try:
                self._codec = TurnCodec(self.tokenizer, tools=self.tools)
            except TemplateError as e:
                raise DataError(f"multi-turn SFT responses need a chat template for tool turns: {e}") from e
        return self._codec

    def _response_lengths(self, responses: list[list[Part]]) -> list[int]:
        """Tokens of each response as :meth:`_build` lays it out (eos tokens and observations included)."""
        texts = [p for parts in responses for p in parts if isinstance(p, str)]
        text_lens = iter(token_lengths(self.tokenizer, texts))
        out = []
        for parts in responses:
            n = 0
            for p in parts:
                n += next(text_lens) + 1 if isinstance(p, str) else len(self._observation_ids(p))
            out.append(n)
        return out

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> SFTExample:
        if not 0 <= i < len(self._rows):
            raise IndexError(f"index {i} out of range for a dataset of {len(self._rows)} examples")
        return self._build_cached(int(i))

    def _image_prompt(self, row: int, cells: dict[str, Any], text: str) -> ImagePrompt:
        return image_prompt(self.processor, self.source, row, cells, text)

    def _build(self, i: int) -> SFTExample:
        row = int(self._rows[i])
        cells = self.source.table.slice(row, 1).to_pylist()[0]
        prompt, parts = self._parse(row, cells)
        image = self._image_prompt(row, cells, prompt) if self.processor is not None else None
        input_ids = image.token_ids if image is not None else encode(self.tokenizer, prompt)
        loss_mask = [0] * len(input_ids)
        # A multi-turn demonstration ends each turn with the template's end-of-turn token, which the
        # rollout stops on (the eos for ChatML instruct tokenizers; not for a base model's eos).
        multi_turn = any(not isinstance(p, str) for p in parts)
        end_id = self._turn_end_id() if multi_turn else self.response_end_id
        for p in parts:
            if isinstance(p, str):
                ids = encode(self.tokenizer, p) + [end_id]
                loss_mask += [1] * len(ids)
            else:
                ids = self._observation_ids(p)
                loss_mask += [0] * len(ids)
            input_ids += ids
        return SFTExample(input_ids=input_ids, loss_mask=loss_mask, images=image.pixels if image else None)


def collate_sft(examples: list[SFTExample], pad_id: int, pad_to_multiple_of: int = 1) -> SFTBatch:
    """Right-pads examples to the longest (rounded up to ``pad_to_multiple_of``); pads get attention 0, loss 0."""
    if not examples:
        raise ValueError("collate_sft needs at least one example")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    longest = max(len(e.input_ids) for e in examples)
    T = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[b, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(e.loss_mask, dtype=torch.long)
    # Right padding: real tokens sit at 0..n-1; pads get 0 (they are masked out of attention and loss).
    positions = torch.arange(T, dtype=torch.long).expand(B, T) * attention
    parts = [e.images for e in examples if e.images is not None]
    return SFTBatch(
        input_ids_BT=input_ids,
        attention_mask_BT=attention,
        loss_mask_BT=loss_mask,
        position_ids_BT=positions,
        images=ImageInputs.cat(parts) if parts else None,
    )
