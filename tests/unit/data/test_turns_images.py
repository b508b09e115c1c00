"""Image observations (spmdrl/data/turns.py TurnCodec.observation) with the built-in tiny VLM's tokenizer,
chat template and processor: a tool message's image parts are one placeholder each in the engine's ids and
the processor's expansion in the trainer's, with their pixel values in order; a text model refuses them."""

from __future__ import annotations

from typing import Any

import pytest
from PIL import Image

from spmdrl.data.turns import Observation, TemplateError, TurnCodec, message_images


@pytest.fixture(scope="module")
def vl() -> tuple[Any, Any]:
    from spmdrl.models.load import load_processor, load_tokenizer
    from spmdrl.models.tiny import TINY_VL, default_cache_dir, ensure_tiny_model

    model_dir = ensure_tiny_model(default_cache_dir(), TINY_VL)  # the tests' shared cache: built once
    return load_tokenizer(model_dir), load_processor(model_dir)


def _tool(text: str, *colors: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image", "image": Image.new("RGB", (30, 20), c)} for c in colors]
    return {"role": "tool", "content": [*parts, {"type": "text", "text": text}]}


def test_an_image_observation_is_one_placeholder_for_the_engine_and_expanded_for_the_trainer(vl) -> None:  # noqa: ANN001
    from spmdrl.models.tiny_vl import FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKENS

    tok, processor = vl
    codec = TurnCodec(tok, processor=processor)
    messages = [_tool("two pictures", "red", "blue"), {"role": "tool", "content": "and text"}]
    obs = codec.observation(messages)
    image, fake, glob = tok.convert_tokens_to_ids([IMAGE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN])
    assert obs.engine_ids.count(image) == 2
    # The trainer's ids are the engine's with each placeholder expanded as vLLM expands it.
    expanded: list[int] = []
    for t in obs.engine_ids:
        expanded += [fake, glob, *[image] * IMAGE_TOKENS, fake] if t == image else [t]
    assert obs.ids == expanded
    # The text around the images is the template's, as for a text observation.
    text_only = codec.observation([{"role": "tool", "content": "two pictures"}])
    assert text_only == Observation(text_only.ids, text_only.ids) and text_only.pixels is None
    assert tok.decode(obs.engine_ids).replace(IMAGE_TOKEN * 2, "") == tok.decode(
        codec.observation_ids(
            [{"role": "tool", "content": "two pictures"}, {"role": "tool", "content": "and text"}]
        )
    )
    # The pixel values: one row, the images in order (red, then blue).
    assert obs.pixels is not None and obs.pixels.counts_B == (2,)
    red, blue = obs.pixels.pixel_values_NCHW[:, :, 10, 10]
    assert red[0] > red[2] and blue[2] > blue[0]
    assert len(obs.images) == 2 and message_images(messages) == obs.images


def test_a_text_model_refuses_an_image_observation(vl) -> None:  # noqa: ANN001
    tok, _ = vl
    with pytest.raises(TemplateError, match="1 image\\(s\\) but the model is a text model"):
        TurnCodec(tok).observation([_tool("a picture", "red")])


def test_an_image_part_without_its_image_is_named(vl) -> None:  # noqa: ANN001
    tok, processor = vl
    with pytest.raises(TemplateError, match="'tool' message has an image part without its image"):
        TurnCodec(tok, processor=processor).observation([{"role": "tool", "content": [{"type": "image"}]}])
