"""RL prompt datasets: chat-templated, tokenized prompts with their ground truth, from verl-schema parquet.

Every rank opens the same files and computes every prompt's token length, so that the overlong filter
gives all ranks the same index space (ranks that disagreed on the dataset size would disagree on the
number of steps per epoch and deadlock in a collective). Lengths come from the fast tokenizer's batch
encoder, which is cheap; the full example (ids, messages, ground truth) is built lazily in
``__getitem__`` and cached, so a rank only builds the items its sampler hands it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from spmdrl.data import images
from spmdrl.data.parquet import (
    DataError,
    ParquetSource,
    to_extra_info,
    to_ground_truth,
    to_messages,
)
from spmdrl.data.sources import ReadOptions, read_sources

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from spmdrl.data.vision import ImagePrompt

# Rows rendered and length-encoded per batch in the length pass: bounds the Python objects alive at once.
_CHUNK_ROWS = 2048
# Built examples kept per dataset; a rank revisits its items once per epoch, so a modest cache is enough.
_CACHE_ITEMS = 16384


@dataclass(frozen=True)
class PromptExample:
    """One RL prompt. Shared with the dataset's cache: treat the lists and dicts as read-only."""

    index: int  # position in the dataset after filtering (what the sampler hands out)
    prompt_ids: list[int]
    messages: list[dict[str, str]]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any]
    # A vision-language model's prompt (spmdrl.data.vision): prompt_ids are its expanded ids (the
    # trainer's), this holds the engine's ids, the images and their pixel values. None for a text model.
    image: ImagePrompt | None = None


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    *,
    where: str,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The chat-templated conversation, ending with the generation prompt for the assistant's turn.
    ``tools``: the tool schemas a multi-turn rollout offers (the template describes them to the model)."""
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except (ValueError, jinja2.TemplateError) as e:  # no template (ValueError), or the template rejected it
        raise DataError(
            f"{where}: the tokenizer's chat template failed on this prompt ({type(e).__name__}: {e}); "
            "use a tokenizer with a chat template that accepts these messages"
        ) from e


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` without added special tokens (the chat template already wrote them)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The same call token_lengths makes, so a length computed there is this list's length.
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


def token_lengths(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[int]:
    """Number of tokens of each text, as :func:`encode` would give, encoded in one parallel batch."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [len(e) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def check_overlong(overlong: str) -> None:
    if overlong not in ("filter", "error"):
        raise DataError(f"data.overlong={overlong!r} is not one of filter, error")


def fits(n_tokens: int, limit: int, *, what: str, key: str, where: str, overlong: str) -> bool:
    """Whether a sample of ``n_tokens`` fits ``limit``; in "error" mode a sample that does not raises."""
    if n_tokens <= limit:
        return True
    if overlong == "error":
        raise DataError(
            f"{where}: the {what} is {n_tokens} tokens, more than {key}={limit}; "
            f"raise {key}, or set data.overlong=filter to drop such samples"
        )
    return False


def iter_row_chunks(source: ParquetSource) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(first global row, rows as dicts) for consecutive chunks of the table."""
    for start in range(0, source.table.num_rows, _CHUNK_ROWS):
        yield start, source.table.slice(start, _CHUNK_ROWS).to_pylist()


def no_rows_left(source: ParquetSource, key: str) -> DataError:
    return DataError(
        f"every sample in {', '.join(map(str, source.paths))} is longer than the limits; raise {key}"
    )


class PromptDataset:
    """Prompts of verl-schema parquet files; ``num_filtered`` counts those dropped as too long."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_key: str,
        max_prompt_length: int,
        overlong: str,
        tools: list[dict[str, Any]] | None = None,
        options: ReadOptions | None = None,
        processor: Any | None = None,
    ) -> None:
        check_overlong(overlong)
        self.tokenizer = tokenizer
        self.tools = tools
        self.prompt_key = prompt_key
        # A vision-language model's processor (spmdrl.data.vision): prompts may carry images.
        self.processor = processor
        self.source = read_sources(
            paths,
            [prompt_key, "reward_model"],
            optional_columns=["data_source", "extra_info", *([images.IMAGES_COLUMN] if processor else [])],
            column_keys={prompt_key: "data.prompt_key"},
            options=options,
        )
        kept: list[int] = []
        for start, rows in iter_row_chunks(self.source):
            # Parsing every row here also validates every cell before any heavy initialisation.
            texts = [self._parse(start + j, row)[1] for j, row in enumerate(rows)]
            if processor is not None:  # expanded image tokens count: each image decoded and checked now
                lengths = [
                    len(self._image_prompt(start + j, row, t).token_ids)
                    for j, (row, t) in enumerate(zip(rows, texts, strict=True))
                ]
            else:
                lengths = token_lengths(tokenizer, texts)
            for j, n in enumerate(lengths):
                where = self.source.where(start + j)
                key = "data.max_prompt_length"
                if fits(
                    n,
                    max_prompt_length,
                    what="chat-templated prompt",
                    key=key,
                    where=where,
                    overlong=overlong,
                ):
                    kept.append(start + j)
        if not kept:
            raise no_rows_left(self.source, "data.max_prompt_length")
        self._rows = np.asarray(kept, dtype=np.int64)
        self.num_filtered = self.source.table.num_rows - len(kept)
        self._build_cached = functools.lru_cache(maxsize=_CACHE_ITEMS)(self._build)

    def _parse(self, row: int, cells: dict[str, Any]) -> tuple[list[dict[str, str]], str]:
        where = self.source.where(row)
        messages = to_messages(
            cells[self.prompt_key], where=where, column=self.prompt_key, key="data.prompt_key"
        )
        placeholders = images.count_placeholders(messages)
        if self.processor is not None:
            images.check_count(cells.get(images.IMAGES_COLUMN), placeholders, where=where)
        elif placeholders:
            raise DataError(
                f"{where}: the prompt has {images.PLACEHOLDER} placeholder(s), but the model is a text model; "
                "use a vision-language model (docs/models.md#vision-language-models) or remove the "
                "placeholders"
            )
        to_ground_truth(cells["reward_model"], where=where)
        to_extra_info(cells.get("extra_info"), where=where)
        # A VLM's template reads images as parts of a message's content (images.as_parts).
        rendered = images.as_parts(messages) if self.processor is not None else messages
        return messages, render_prompt(self.tokenizer, rendered, where=where, tools=self.tools)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> PromptExample:
        if not 0 <= i < len(self._rows):
            raise IndexError(f"index {i} out of range for a dataset of {len(self._rows)} prompts")
        return self._build_cached(int(i))

    def _image_prompt(self, row: int, cells: dict[str, Any], text: str) -> ImagePrompt:
        return images.image_prompt(self.processor, self.source, row, cells, text)

    def _build(self, i: int) -> PromptExample:
        row = int(self._rows[i])
        cells = self.source.table.slice(row, 1).to_pylist()[0]
        where = self.source.where(row)
        messages, text = self._parse(row, cells)
        data_source = cells.get("data_source")
        image = self._image_prompt(row, cells, text) if self.processor is not None else None
        return PromptExample(
            index=i,
            image=image,
            prompt_ids=image.token_ids if image is not None else encode(self.tokenizer, text),
            messages=messages,
            ground_truth=to_ground_truth(cells["reward_model"], where=where),
            data_source="" if data_source is None else str(data_source),
            extra_info=to_extra_info(cells.get("extra_info"), where=where),
        )
