"""A vision-language model's images as the trainer's forward and the engine take them.

A prompt has two forms. The engine gets one placeholder token per image (``<image>``, as the tokenizer
writes the text) with the PIL images beside the ids (spmdrl.rollout.vllm_engine.VLLMEngine.generate), and
vLLM expands each placeholder to the image's tokens itself (it would expand an already expanded prompt a
second time). The trainer scores the expanded ids (Idefics3: ``<fake_token_around_image><global-img>
<image> x n <fake_token_around_image>``, as the model's processor writes them, which is what vLLM's
expansion gives: tests/integration/test_vlm.py) with the processor's pixel values (:class:`ImageInputs`),
which fill the image tokens in order. A multi-turn row's images are its prompt's, then those its tools
returned (spmdrl.data.turns.Observation, :meth:`ImageInputs.join`), in the order of their image tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmdrl.transfer import to_device


@dataclass(frozen=True)
class ImageInputs:
    """The images of some rows, in row order (a row's images in prompt order): what fills the rows' image
    tokens in the model's forward. ``counts_B``: each row's number of images."""

    pixel_values_NCHW: torch.Tensor
    # 1 on real pixels, 0 on the padding the processor added to square an image (Idefics3); None: all real.
    pixel_attention_mask_NHW: torch.Tensor | None
    counts_B: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.counts_B) != self.pixel_values_NCHW.shape[0]:
            raise ValueError(
                f"ImageInputs: {self.pixel_values_NCHW.shape[0]} images for rows of {list(self.counts_B)} images"
            )

    def rows(self, indices: Sequence[int]) -> ImageInputs:
        """The images of rows ``indices`` (a micro-batch), in that order."""
        starts = [0]
        for n in self.counts_B:
            starts.append(starts[-1] + n)
        picked = [i for r in indices for i in range(starts[r], starts[r + 1])]
        index = torch.tensor(picked, dtype=torch.long)
        mask = self.pixel_attention_mask_NHW
        return ImageInputs(
            self.pixel_values_NCHW.index_select(0, index),
            mask.index_select(0, index) if mask is not None else None,
            tuple(self.counts_B[r] for r in indices),
        )

    def model_kwargs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """The forward's image arguments. Idefics3 takes (batch, images, C, H, W) and fills the image tokens
        of the whole batch in order with the images flattened in order, so one "row" of every image is the
        same as one row of images per row, without the all-zero padding images of uneven rows."""
        if self.pixel_values_NCHW.shape[0] == 0:
            return {}  # rows without images: the decoder alone
        out: dict[str, Any] = {"pixel_values": to_device(self.pixel_values_NCHW, device).to(dtype)[None]}
        if self.pixel_attention_mask_NHW is not None:
            out["pixel_attention_mask"] = to_device(self.pixel_attention_mask_NHW, device)[None]
        return out

    @staticmethod
    def empty() -> ImageInputs:
        """One row without images (a text prompt of a vision-language model)."""
        return ImageInputs(torch.zeros(0, 3, 1, 1), None, (0,))

    @staticmethod
    def join(parts: Sequence[ImageInputs | None]) -> ImageInputs:
        """One row of every image of ``parts`` in order (a multi-turn row: its prompt's images, then the
        images its tools returned); None parts add nothing."""
        present = [p for p in parts if p is not None]
        if not present:
            return ImageInputs.empty()
        joined = ImageInputs.cat(present)
        return ImageInputs(joined.pixel_values_NCHW, joined.pixel_attention_mask_NHW, (sum(joined.counts_B),))

    @staticmethod
    def cat(parts: Sequence[ImageInputs]) -> ImageInputs:
        counts = tuple(n for p in parts for n in p.counts_B)
        parts = [p for p in parts if p.pixel_values_NCHW.shape[0] > 0] or list(parts[:1])
        masks = [p.pixel_attention_mask_NHW for p in parts]
        return ImageInputs(
            torch.cat([p.pixel_values_NCHW for p in parts]),
            torch.cat(masks) if all(m is not None for m in masks) else None,  # type: ignore[arg-type]
            counts,
        )


@dataclass(frozen=True)
class ImagePrompt:
    """One prompt of a vision-language model: its token ids with the image tokens expanded (the trainer's),
    with one placeholder per image (the engine's), and its images."""

    token_ids: list[int]
    engine_ids: list[int]
    images: list[Any]  # PIL images, for the engine
    pixels: ImageInputs  # the same images as the trainer's forward takes them (one row)


def encode_prompt(processor: Any, text: str, images: Sequence[Any]) -> ImagePrompt:
    """``text`` (the chat template applied, one image placeholder per image) and its PIL ``images`` through
    the model's processor: the expanded token ids and the pixel values."""
    # No added special tokens: the chat template wrote them (spmdrl.data.prompts.encode).
    out = processor(
        text=[text], images=[list(images)] if images else None, add_special_tokens=False, return_tensors="pt"
    )
    ids = out["input_ids"][0].tolist()
    engine_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not images:
        return ImagePrompt(ids, engine_ids, [], ImageInputs.empty())
    pixel_values = out["pixel_values"]  # (1, images, C, H, W)
    mask = out.get("pixel_attention_mask")
    return ImagePrompt(
        ids,
        engine_ids,
        list(images),
        ImageInputs(pixel_values[0], mask[0] if mask is not None else None, (pixel_values.shape[1],)),
    )


def image_token_ids(processor: Any) -> list[int]:
    """The tokens only the processor writes (an image's placeholder and delimiters, a tile's position:
    Idefics3's ``<image>``, ``<fake_token_around_image>``, ``<global-img>``, ``<row_i_col_j>``). The engine
    never samples them and the trainer's head leaves them out the same way (spmdrl.models.head.BANNED_TOKENS):
    a sampled ``<image>`` in a response would be taken for an image's place by the trainer's forward, which
    fills every image token of a row with image features, while the engine embeds it as a token."""
    ids = {
        getattr(processor, a, None)
        for a in ("image_token_id", "fake_image_token_id", "global_image_token_id")
    }
    ids |= set(getattr(processor, "row_col_ids", None) or ())
    unk = getattr(processor.tokenizer, "unk_token_id", None)
    return sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != unk)
