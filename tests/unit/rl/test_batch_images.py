"""A vision-language model's images follow their rows through every selection of a PolicyBatch (take,
select, rows, split, concat), so that a micro-batch's forward gets exactly its rows' images in row order;
a multi-turn row's images are its prompt's then its tools' (and a prompt without images shifts no other
row's); the images survive the exchange's per-row fields (pack_images / unpack_images) bit-exact, as wide
as any wire pads them; and the start refuses what a VLM does not support yet, naming the key, and lets the
placements that move rows run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmdrl.config import Config
from spmdrl.data.vision import ImageInputs
from spmdrl.errors import ConfigError
from spmdrl.preflight import check_vision_model
from spmdrl.rl.batch import (
    IMAGE_MASK,
    IMAGE_SHAPE,
    IMAGES,
    PolicyBatch,
    build_policy_batch,
    pack_images,
    unpack_images,
)
from spmdrl.rollout.engine import Generation


def _batch(counts: tuple[int, ...]) -> PolicyBatch:
    """Rows whose input ids are their row numbers, and whose images are filled with their row number."""
    B = len(counts)
    ids = torch.arange(B)[:, None].expand(B, 3).clone()
    pixels = torch.cat([torch.full((n, 3, 2, 2), float(r)) for r, n in enumerate(counts)])
    ones = torch.ones(B, 3)
    return PolicyBatch(ids, ones.long(), ones.bool(), ones, ones, images=ImageInputs(pixels, None, counts))


def _rows_of(batch: PolicyBatch) -> list[float]:
    """The row number each image of the batch was drawn for."""
    assert batch.images is not None
    return batch.images.pixel_values_NCHW[:, 0, 0, 0].tolist()


def test_images_follow_their_rows() -> None:
    b = _batch((1, 2, 0, 1))  # row 2 has no image
    taken = b.take(torch.tensor([3, 1]), width=3)
    assert taken.input_ids_BT[:, 0].tolist() == [3, 1]
    assert taken.images.counts_B == (1, 2) and _rows_of(taken) == [3.0, 1.0, 1.0]
    assert _rows_of(b.select(torch.tensor([2, 0]))) == [0.0]
    first, second = b.split([2, 2])
    assert _rows_of(first) == [0.0, 1.0, 1.0] and _rows_of(second) == [3.0]
    assert _rows_of(b.rows(1, 3)) == [1.0, 1.0]
    joined = PolicyBatch.concat([second, first])
    assert joined.images.counts_B == (0, 1, 1, 2) and _rows_of(joined) == [3.0, 0.0, 1.0, 1.0]
    # The exchange moves the images as per-row fields (test_images_round_trip_through_the_wires_fields).
    assert "images" not in b.tensors() and IMAGES in b.tensors()
    # A micro-batch without images runs the decoder alone.
    assert b.select(torch.tensor([2])).images.model_kwargs(torch.device("cpu"), torch.float32) == {}


@pytest.mark.parametrize(
    ("section", "change", "named"),
    [
        ("trainer", {"pack_sequences": True}, "trainer.pack_sequences=true"),
        ("rollout", {"partial": "continue"}, "rollout.partial=continue"),
        ("parallel", {"placement": "split"}, "parallel.placement=split"),
    ],
)
def test_what_a_vlm_does_not_support_is_refused_at_start(section: str, change: dict, named: str) -> None:
    cfg = Config()
    cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **change)})
    model = dataclasses.replace(cfg.model, path="tiny-vl")
    with pytest.raises(ConfigError, match="vision-language model") as e:
        check_vision_model(model, cfg.trainer, cfg.rollout, cfg.parallel)
    assert named in str(e.value) and "docs/models.md#vision-language-models" in str(e.value)
    lora = dataclasses.replace(model, lora=dataclasses.replace(model.lora, rank=8))
    with pytest.raises(ConfigError, match="LoRA on one is not supported"):
        check_vision_model(lora, Config().trainer, Config().rollout, Config().parallel)


def test_multi_turn_rollouts_of_a_vlm_are_not_refused() -> None:
    cfg = Config()
    rollout = dataclasses.replace(
        cfg.rollout, multi_turn=dataclasses.replace(cfg.rollout.multi_turn, enable=True)
    )
    model = dataclasses.replace(cfg.model, path="tiny-vl")
    assert "vision-language model" in check_vision_model(model, cfg.trainer, rollout, cfg.parallel)


def _pixels(*values: float) -> ImageInputs:
    """One row of images, each filled with its value."""
    return ImageInputs(torch.stack([torch.full((3, 2, 2), v) for v in values]), None, (len(values),))


def _gen(prompt: int, images: ImageInputs | None) -> Generation:
    return Generation(prompt, [7, 8], [-1.0, -1.0], "stop", loss_mask=[1, 0], images=images)


def test_a_rows_images_are_its_prompts_then_its_tools() -> None:
    # Prompt 1 has no images (None: a text prompt of the VLM's data); its samples' tools returned some.
    prompt_images = [_pixels(0.0), None, _pixels(2.0, 2.5)]
    gens = [
        _gen(0, _pixels(10.0)),
        _gen(0, None),
        _gen(1, _pixels(11.0, 11.5)),
        _gen(1, None),
        _gen(2, _pixels(12.0)),
    ]
    batch = build_policy_batch([[1], [1], [1]], gens, pad_id=0, images=prompt_images)
    assert batch.images is not None and batch.images.counts_B == (2, 1, 2, 0, 3)
    assert _rows_of(batch) == [0.0, 10.0, 0.0, 11.0, 11.5, 2.0, 2.5, 12.0]
    with pytest.raises(ValueError, match="2 prompts' images for 3 prompts"):
        build_policy_batch([[1], [1], [1]], gens, pad_id=0, images=prompt_images[:2])


def test_experience_rows_keep_each_prompts_images() -> None:
    """spmdrl.rl.experience.policy_batch: a prompt without images (between two with) takes no other's."""
    from spmdrl.data.prompts import PromptExample
    from spmdrl.data.vision import ImagePrompt
    from spmdrl.rewards.sandbox import RewardResult
    from spmdrl.rl.experience import policy_batch
    from spmdrl.rl.samples import ScoredSamples

    def prompt(i: int, pixels: ImageInputs | None) -> PromptExample:
        image = None if pixels is None else ImagePrompt([1], [1], [], pixels)
        return PromptExample(i, [1], [], "", "", {}, image=image)

    prompts = [prompt(0, None), prompt(1, _pixels(1.0)), prompt(2, None)]
    gens = [_gen(0, _pixels(10.0)), _gen(1, None), _gen(2, None)]
    scores = torch.zeros(3)
    samples = ScoredSamples(prompts, gens, RewardResult(scores, 0, 0), ["", "", ""], scores)
    batch = policy_batch(samples, pad_id=0, device=torch.device("cpu"))
    assert batch.images is not None and batch.images.counts_B == (1, 1, 0)
    assert _rows_of(batch) == [10.0, 1.0]


def _images(counts: tuple[int, ...], mask: bool) -> ImageInputs:
    g = torch.Generator().manual_seed(len(counts))
    n = sum(counts)
    pixels = torch.randn(n, 3, 4, 5, generator=g)
    return ImageInputs(pixels, torch.randint(0, 2, (n, 4, 5), generator=g) if mask else None, counts)


@pytest.mark.parametrize("mask", [True, False])
def test_images_round_trip_through_the_wires_fields(mask: bool) -> None:
    images = _images((2, 0, 1, 3, 0), mask)  # uneven counts, rows without images
    wire = pack_images(images, 5, torch.device("cpu"))
    assert wire[IMAGES].shape == (5, 3 * 3 * 4 * 5) and wire[IMAGE_SHAPE][:, 0].tolist() == [2, 0, 1, 3, 0]
    assert wire[IMAGE_MASK].shape == ((5, 3 * 4 * 5) if mask else (5, 0))
    # The mask travels as bool (a byte a pixel; the processor's int64 took eight) and arrives as int64, 0/1.
    assert wire[IMAGE_MASK].dtype == torch.bool
    # A wire pads every field with 0 past the widest row it carried (spmdrl.distributed.exchange).
    padded = {k: torch.nn.functional.pad(v.double(), (0, 7)).to(v.dtype) for k, v in wire.items()}
    for fields in (wire, padded):
        back = unpack_images(fields)
        assert back is not None and back.counts_B == images.counts_B
        assert torch.equal(back.pixel_values_NCHW, images.pixel_values_NCHW)
        if mask:
            assert back.pixel_attention_mask_NHW is not None
            assert back.pixel_attention_mask_NHW.dtype == torch.long
            assert torch.equal(back.pixel_attention_mask_NHW, images.pixel_attention_mask_NHW)
        else:
            assert back.pixel_attention_mask_NHW is None
    # Whole batches, in row order, with the token fields (PolicyBatch.tensors / from_tensors).
    b = _batch((1, 2, 0, 1))
    again = PolicyBatch.from_tensors(b.tensors())
    assert again.images.counts_B == (1, 2, 0, 1) and _rows_of(again) == _rows_of(b)
    assert torch.equal(again.input_ids_BT, b.input_ids_BT)
    # Rows from several ranks: some images with a mask, some without (every pixel real), none at all.
    parts = [
        pack_images(_images((1, 2), True), 2, torch.device("cpu")),
        pack_images(_images((1,), False), 1, torch.device("cpu")),
    ]
    joined = {
        k: torch.cat(
            [
                torch.nn.functional.pad(p[k], (0, max(q[k].shape[1] for q in parts) - p[k].shape[1]))
                for p in parts
            ]
        )
        for k in parts[0]
    }
    mixed = unpack_images(joined)
    assert mixed is not None and mixed.counts_B == (1, 2, 1)
    assert torch.equal(mixed.pixel_attention_mask_NHW[:3], _images((1, 2), True).pixel_attention_mask_NHW)
    assert bool(mixed.pixel_attention_mask_NHW[3].eq(1).all())
    empty = unpack_images(pack_images(ImageInputs.cat([ImageInputs.empty()] * 3), 3, torch.device("cpu")))
    assert empty is not None and empty.counts_B == (0, 0, 0) and empty.pixel_values_NCHW.shape[0] == 0
    # A text model's rows: no images travel, none arrive.
    assert unpack_images(pack_images(None, 3, torch.device("cpu"))) is None
    assert IMAGES not in _batch((0,)).replace(images=None).tensors()


def test_images_of_different_shapes_cannot_arrive_together() -> None:
    a = pack_images(_images((1,), False), 1, torch.device("cpu"))
    b = pack_images(ImageInputs(torch.zeros(1, 3, 2, 2), None, (1,)), 1, torch.device("cpu"))
    joined = {
        k: torch.cat(
            [
                torch.nn.functional.pad(p[k], (0, max(a[k].shape[1], b[k].shape[1]) - p[k].shape[1]))
                for p in (a, b)
            ]
        )
        for k in a
    }
    with pytest.raises(ValueError, match="different shapes"):
        unpack_images(joined)


@pytest.mark.parametrize(
    ("section", "change"),
    [
        ("parallel", {"placement": "async"}),
        ("parallel", {"teacher_ranks": 1}),
        ("parallel", {"balance_tokens": True}),
    ],
)
def test_the_placements_that_move_rows_are_not_refused(section: str, change: dict) -> None:
    cfg = Config()
    cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **change)})
    model = dataclasses.replace(cfg.model, path="tiny-vl")
    assert "vision-language model" in check_vision_model(model, cfg.trainer, cfg.rollout, cfg.parallel)
