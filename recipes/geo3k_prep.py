"""Geometry3K -> ``train.parquet`` and ``test.parquet`` in verl's multimodal schema, for
``recipe=grpo_geo3k_vlm`` (docs/models.md#vision-language-models).

    python -m spmdrl.recipes.geo3k_prep --out ~/data/geo3k      # from the Hugging Face hub

Needs the ``datasets`` library (the ``data`` extra). Each row is what verl's geo3k preprocessing writes:
the problem's text with its ``<image>`` placeholder, the figure's encoded bytes in the ``images`` column
(one per placeholder), and the answer as the ground truth::

    data_source   "hiyouga/geometry3k"
    prompt        [{"role": "user", "content": "<image>Find x. ... Put the final answer in \\boxed{}."}]
    images        [{"bytes": <PNG>, "path": null}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "3"}
    extra_info    {"split": "train", "index": 0, "answer": "3", "question": "<the problem>"}
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from spmdrl.data.images import PLACEHOLDER
from spmdrl.data.parquet import IMAGES, DataError, verl_schema, write_splits
from spmdrl.data.sources import load_hub_dataset

DATA_SOURCE = "hiyouga/geometry3k"
SPLITS = ("train", "test")
DEFAULT_OUT = "~/data/geo3k"
INSTRUCTION = "Think step by step, then put the final answer in \\boxed{}."

SCHEMA = verl_schema(
    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())],
    after_prompt=[("images", IMAGES)],
)


def _image_bytes(image: Any, where: str) -> bytes:
    """An image as the hub gives it (a PIL image, or HF datasets' {"bytes", "path"} struct) as PNG bytes."""
    if isinstance(image, dict) and isinstance(image.get("bytes"), (bytes, bytearray)):
        return bytes(image["bytes"])
    if hasattr(image, "save"):
        out = io.BytesIO()
        image.convert("RGB").save(out, format="PNG")
        return out.getvalue()
    raise DataError(
        f"{where}: an image must be a PIL image or a {{'bytes', 'path'}} struct, got {type(image).__name__}"
    )


def convert(rows: Iterable[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """Geometry3K ``{"images", "problem", "answer"}`` rows -> verl-schema rows (see the module docstring).
    A problem without its placeholder gets one in front (the figure comes first, as verl's prompts put it)."""
    out = []
    for index, row in enumerate(rows):
        where = f"{DATA_SOURCE} ({split} split) row {index}"
        problem, answer, images = row.get("problem"), row.get("answer"), row.get("images")
        if not isinstance(problem, str) or not isinstance(answer, str) or not isinstance(images, list):
            raise DataError(
                f"{where}: expected string 'problem' and 'answer' and a list 'images', got {sorted(row)}"
            )
        text = problem if PLACEHOLDER in problem else PLACEHOLDER + problem
        out.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{text} {INSTRUCTION}"}],
                "images": [{"bytes": _image_bytes(im, where), "path": None} for im in images],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
            }
        )
    return out


def prepare(out_dir: Path) -> dict[str, Path]:
    dd = load_hub_dataset(DATA_SOURCE, instead="download it where the hub is reachable and copy the files")
    converted = {split: convert(dd[split], split) for split in SPLITS}
    return write_splits(converted, out_dir, SCHEMA)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=f"default {DEFAULT_OUT}")
    args = parser.parse_args(argv)
    try:
        paths = prepare(args.out.expanduser())
    except DataError as e:
        print(f"geo3k_prep: error: {e}", file=sys.stderr)
        sys.exit(2)
    for split, path in paths.items():
        print(f"{split}: {pq.ParquetFile(path).metadata.num_rows} rows -> {path}")


if __name__ == "__main__":
    main()
