"""A vision-language model's images follow their rows through every selection of a PolicyBatch (take,
select, rows, split, concat), so that a micro-batch's forward gets exactly its rows' images in row order;
and the start refuses what a VLM does not support yet, naming the key."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmdrl.config import Config
from spmdrl.data.vision import ImageInputs
from spmdrl.errors import ConfigError
from spmdrl.preflight import check_vision_model
from spmdrl.rl.batch import PolicyBatch


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
    # The exchange moves tensors only (the placements that would move images are refused at start).
    assert "images" not in b.tensors()
    # A micro-batch without images runs the decoder alone.
    assert b.select(torch.tensor([2])).images.model_kwargs(torch.device("cpu"), torch.float32) == {}


@pytest.mark.parametrize(
    ("section", "change", "named"),
    [
        ("trainer", {"pack_sequences": True}, "trainer.pack_sequences=true"),
        ("rollout", {"partial": "continue"}, "rollout.partial=continue"),
        ("parallel", {"placement": "async"}, "parallel.placement=async"),
        ("parallel", {"teacher_ranks": 1}, "parallel.teacher_ranks=1"),
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
