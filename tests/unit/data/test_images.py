"""A vision-language model's prompts from verl's multimodal schema (spmdrl.data.images, PromptDataset and
SFTDataset with the built-in tiny-vl's processor): images as bytes, paths and {bytes, path} structs become
the expanded ids the trainer scores and the placeholder ids the engine expands; a bad image (a missing
file, bytes that are no image, more or fewer images than placeholders) is a DataError naming the file, the
row and the fix, raised when the dataset is read."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmdrl.data.parquet import DataError
from spmdrl.data.prompts import PromptDataset
from spmdrl.data.sft import SFTDataset, collate_sft

QUESTION = "<image>How many squares? Give the answer after ####."


@pytest.fixture(scope="module")
def vl():  # noqa: ANN201 - (tokenizer, processor)
    from spmdrl.models.load import load_processor, load_tokenizer
    from spmdrl.models.tiny import TINY_VL, default_cache_dir, ensure_tiny_model

    model_dir = ensure_tiny_model(default_cache_dir(), TINY_VL)  # the tests' shared cache: built once
    return load_tokenizer(model_dir), load_processor(model_dir)


def _png(color: str = "red") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(out, format="PNG")
    return out.getvalue()


def _write(path: Path, rows: list[dict]) -> Path:
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("prompt", pa.string()),
            ("images", pa.list_(image)),
            ("reward_model", pa.struct([("ground_truth", pa.string())])),
            ("response", pa.string()),
        ]
    )
    full = [{"reward_model": {"ground_truth": "1"}, "response": "#### 1", **r} for r in rows]
    pq.write_table(pa.Table.from_pylist(full, schema=schema), path)
    return path


def _prompts(path: Path, vl, **kw) -> PromptDataset:  # noqa: ANN001
    tokenizer, processor = vl
    return PromptDataset(
        [path],
        tokenizer,
        prompt_key="prompt",
        max_prompt_length=64,
        overlong="error",
        processor=processor,
        **kw,
    )


def test_images_as_bytes_and_paths_expand_for_the_trainer_and_stay_placeholders_for_the_engine(
    tmp_path: Path, vl
) -> None:  # noqa: ANN001
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "blue.png").write_bytes(_png("blue"))
    path = _write(
        tmp_path / "d.parquet",
        [
            {"prompt": QUESTION, "images": [{"bytes": _png(), "path": None}]},
            {"prompt": QUESTION, "images": [{"bytes": None, "path": "pics/blue.png"}]},  # from the file's dir
            {"prompt": "no image here", "images": []},
        ],
    )
    ds = _prompts(path, vl)
    tokenizer, processor = vl
    image_id = processor.image_token_id
    for i in (0, 1):
        ex = ds[i]
        assert ex.image is not None and len(ex.image.images) == 1
        assert ex.image.engine_ids.count(image_id) == 1  # the engine expands the placeholder itself
        assert ex.prompt_ids.count(image_id) == 4  # the trainer scores the expanded ids: 4 per image
        assert ex.image.pixels.pixel_values_NCHW.shape == (1, 3, 64, 64)
    assert ds[2].image is not None and ds[2].image.pixels.counts_B == (0,)
    # The two pictures differ, and so do their pixels.
    assert not ds[0].image.pixels.pixel_values_NCHW.equal(ds[1].image.pixels.pixel_values_NCHW)
    sft = SFTDataset(
        [path],
        tokenizer,
        prompt_key="prompt",
        response_key="response",
        max_prompt_length=64,
        max_response_length=16,
        overlong="error",
        processor=processor,
    )
    batch = collate_sft([sft[0], sft[2], sft[1]], pad_id=0)
    assert batch.images is not None and batch.images.counts_B == (1, 0, 1)


@pytest.mark.parametrize(
    ("images", "named"),
    [
        ([{"bytes": None, "path": "missing.png"}], "no image file"),
        ([{"bytes": b"not an image at all", "path": None}], "cannot decode the image"),
        ([{"bytes": _png(), "path": None}] * 2, "has 1 <image> placeholder(s) but column 'images' has 2"),
        ([], "has 1 <image> placeholder(s) but column 'images' has 0"),
    ],
)
def test_a_bad_image_is_a_data_error_naming_the_file_row_and_fix(
    tmp_path: Path, vl, images: list, named: str
) -> None:  # noqa: ANN001
    ok = {"prompt": QUESTION, "images": [{"bytes": _png(), "path": None}]}
    path = _write(tmp_path / "d.parquet", [ok, {"prompt": QUESTION, "images": images}])
    with pytest.raises(DataError) as e:
        _prompts(path, vl)
    message = str(e.value)
    assert f"{path} row 1" in message and named in message, message
    if "missing.png" in str(images):
        assert str(tmp_path / "missing.png") in message and "fix the path" in message


def test_placeholders_for_a_text_model_are_refused(tmp_path: Path, vl) -> None:  # noqa: ANN001
    tokenizer, _ = vl
    path = _write(tmp_path / "d.parquet", [{"prompt": QUESTION, "images": [{"bytes": _png(), "path": None}]}])
    with pytest.raises(DataError, match="row 0: the prompt has <image> placeholder.*text model"):
        PromptDataset([path], tokenizer, prompt_key="prompt", max_prompt_length=64, overlong="error")
