"""A vision-language model's images on the async wire (spmdrl/rl/async_rows.py): pack_samples puts each
row's images (its prompt's, then its tools' observations) beside its tokens, unpack gives the trainer rank
the PolicyBatch a colocated rank builds, images in row order, bit-exact through the wire's padding; a
queue saved before the images travelled (a text model's) loads with none."""

from __future__ import annotations

import torch

from spmdrl.data.prompts import PromptExample
from spmdrl.data.vision import ImageInputs, ImagePrompt
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.async_rows import fill_missing_fields, pack_samples, unpack
from spmdrl.rl.batch import IMAGE_MASK, IMAGE_SHAPE, IMAGES
from spmdrl.rl.experience import policy_batch
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rollout.engine import Generation
from spmdrl.testing.rows import IdsTokenizer, PromptsByIndex


def _pixels(n: int, seed: int) -> ImageInputs:
    g = torch.Generator().manual_seed(seed)
    return ImageInputs(
        torch.randn(n, 3, 4, 4, generator=g), torch.randint(0, 2, (n, 4, 4), generator=g), (n,)
    )


def _samples() -> ScoredSamples:
    prompts = [
        PromptExample(3, [1, 2, 3], [], "a", "src", {}, ImagePrompt([1, 2, 3], [1], [], _pixels(1, 0))),
        PromptExample(8, [4, 5], [], "b", "src", {}, ImagePrompt([4, 5], [4], [], _pixels(2, 1))),
    ]
    gens = [
        Generation(0, [20, 21], [-0.5, -0.25], "stop"),
        Generation(0, [22, 23, 24], [-1.0, -2.0, -3.0], "length"),
        # A multi-turn row whose tool returned a picture: its images are its prompt's, then that one.
        Generation(1, [26], [-0.125], "stop", images=_pixels(1, 2)),
        Generation(1, [27, 28], [-0.5, -0.5], "stop"),
    ]
    scores_B = torch.tensor([1.0, 0.0, -0.5, 1.0])
    return ScoredSamples(prompts, gens, RewardResult(scores_B, 0, 0), ["x"] * 4, scores_B)


def test_each_rows_images_reach_the_trainer_rank() -> None:
    cpu = torch.device("cpu")
    samples = _samples()
    rows = pack_samples(samples, 2, {}, 0, cpu)
    assert rows[IMAGE_SHAPE][:, 0].tolist() == [1, 1, 3, 2]
    # The wire pads every field past the widest row of any sender (move_rows with width=None).
    wire = {k: torch.nn.functional.pad(v, (0, 5)) for k, v in rows.items()}
    got = unpack(wire, PromptsByIndex(samples.prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    want = policy_batch(samples, 0, cpu).images
    assert want is not None and got.batch.images is not None
    assert got.batch.images.counts_B == want.counts_B == (1, 1, 3, 2)
    assert torch.equal(got.batch.images.pixel_values_NCHW, want.pixel_values_NCHW)
    assert torch.equal(got.batch.images.pixel_attention_mask_NHW, want.pixel_attention_mask_NHW)


def test_a_queue_saved_before_the_images_travelled_loads_without_images() -> None:
    cpu = torch.device("cpu")
    samples = _samples()
    rows = pack_samples(samples, 2, {}, 0, cpu)
    for name in (IMAGES, IMAGE_MASK, IMAGE_SHAPE):
        rows.pop(name)
    filled = fill_missing_fields(rows, 2)
    assert filled[IMAGE_SHAPE].shape == (4, 0)
    got = unpack(filled, PromptsByIndex(samples.prompts), IdsTokenizer(), 2, 0)  # type: ignore[arg-type]
    assert got.batch.images is None
