"""A prompt's images, from verl's multimodal parquet schema: an ``images`` column beside ``prompt``.

Each row's ``images`` cell is a list with one entry per ``<image>`` placeholder in the prompt text, in
order; an entry is the image's encoded bytes (PNG, JPEG, ...), a path to an image file (relative paths
from the parquet file's directory), or a struct ``{"bytes": ..., "path": ...}`` as the HF ``datasets``
Image feature writes it (verl's geo3k preprocessing). A bad image is a :class:`DataError` that names the
file, the row, the image and the fix, raised while the dataset is read, before the model or the engine is
built.
"""

from __future__ import annotations

import bisect
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spmdrl.data.parquet import DataError, ParquetSource

if TYPE_CHECKING:
    from spmdrl.data.vision import ImagePrompt

IMAGES_COLUMN = "images"
# What a prompt writes for each image (verl's convention); the model's processor expands it.
PLACEHOLDER = "<image>"


def count_placeholders(messages: list[dict[str, str]]) -> int:
    return sum(m["content"].count(PLACEHOLDER) for m in messages)


def as_parts(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Messages whose content is a list of parts, each ``<image>`` placeholder an ``{"type": "image"}`` part
    between ``{"type": "text"}`` parts (transformers' multimodal chat format): what a VLM's chat template
    iterates (SmolVLM's, Qwen2.5-VL's), which would not read a plain string's placeholders."""
    out: list[dict[str, Any]] = []
    for m in messages:
        pieces = m["content"].split(PLACEHOLDER)
        parts: list[dict[str, str]] = []
        for i, text in enumerate(pieces):
            if i > 0:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": m["role"], "content": parts})
    return out


def check_count(cell: Any, placeholders: int, *, where: str) -> int:
    """The number of images of a row's ``images`` cell, which must match the prompt's placeholders."""
    if cell is None:
        n = 0
    elif isinstance(cell, (list, tuple)):
        n = len(cell)
    else:
        raise DataError(
            f"{where}: column {IMAGES_COLUMN!r} must be a list of images (bytes, paths, or {{'bytes', 'path'}} "
            f"structs), got {type(cell).__name__}"
        )
    if n != placeholders:
        raise DataError(
            f"{where}: the prompt has {placeholders} {PLACEHOLDER} placeholder(s) but column "
            f"{IMAGES_COLUMN!r} has {n} image(s); write one {PLACEHOLDER} in the prompt text per image, in "
            "the images' order"
        )
    return n


def to_images(cell: Any, *, where: str, base_dir: Path | None) -> list[Any]:
    """The PIL images (RGB) of a row's ``images`` cell, each decoded now so that a bad one is named here."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for j, entry in enumerate(cell or ()):
        what = f"{where}, column {IMAGES_COLUMN!r}, image {j}"
        data, path = _bytes_or_path(entry, what)
        if data is None:
            assert path is not None
            file = Path(path).expanduser()
            if not file.is_absolute() and base_dir is not None:
                file = base_dir / file
            if not file.is_file():
                raise DataError(
                    f"{what}: no image file {file}; fix the path (relative paths are read from the parquet "
                    "file's directory) or store the image's bytes in the column"
                )
            data = file.read_bytes()
            what = f"{what} ({file})"
        try:
            with Image.open(io.BytesIO(data)) as img:
                out.append(img.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise DataError(
                f"{what}: cannot decode the image ({len(data)} bytes: {type(e).__name__}: {e}); store the "
                "encoded file's bytes (PNG, JPEG, WebP, ...), not raw pixels, or fix the file"
            ) from None
    return out


def _bytes_or_path(entry: Any, what: str) -> tuple[bytes | None, str | None]:
    if isinstance(entry, (bytes, bytearray)):
        return bytes(entry), None
    if isinstance(entry, str):
        return None, entry
    if isinstance(entry, dict):
        data, path = entry.get("bytes"), entry.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            return bytes(data), None
        if isinstance(path, str) and path:
            return None, path
    raise DataError(
        f"{what}: an image must be its encoded bytes, a path, or a {{'bytes', 'path'}} struct with one of them "
        f"set, got {type(entry).__name__}"
    )


def image_prompt(
    processor: Any, source: ParquetSource, row: int, cells: dict[str, Any], text: str
) -> ImagePrompt:
    """A VLM's prompt of ``source``'s ``row``: its images decoded (a bad one is a DataError naming it) and,
    with ``text`` (the chat-templated prompt), through the processor (spmdrl.data.vision.encode_prompt)."""
    from spmdrl.data.vision import encode_prompt

    path = Path(source.paths[bisect.bisect_right(source.row_offsets, row) - 1])
    # A hub dataset's label is no file: relative image paths then stay as given.
    base_dir = path.parent if path.is_file() else None
    decoded = to_images(cells.get(IMAGES_COLUMN), where=source.where(row), base_dir=base_dir)
    return encode_prompt(processor, text, decoded)
