"""The built-in tiny visual task: how many squares a 64 x 64 picture holds (1 to 4), in verl's multimodal
schema, so that the built-in vision-language model (``model.path: tiny-vl``, spmdrl.models.tiny_vl) has a
task it can learn on a CPU. ``data.train_files: ["tiny_shapes:train"]`` generates it (cached).

The picture is a 2 x 2 grid of 32-pixel cells; each of ``count`` random cells holds one square of a random
colour, size and offset. Each of tiny-vl's 4 image tokens sees one cell, so the count is learnable by a
model that small. A row::

    prompt        [{"role": "user", "content": "<image>How many squares are in the picture? Give the answer after ####."}]
    images        [{"bytes": <PNG>, "path": null}]      (as HF datasets' Image feature writes it: verl's geo3k)
    data_source   "spmdrl/tiny_shapes"
    reward_model  {"style": "rule", "ground_truth": "3"}
    extra_info    {"split": "train", "index": 0, "question": "..."}
    response      "#### 3"                                (the SFT demonstration)

The answer is checked by the tiny task's ``#### <answer>`` rule (spmdrl.rewards.tiny). As in the arithmetic
task, ``correct_fraction`` below 1 makes the rest of the train demonstrations systematically wrong by
``wrong_offset``, so that a warm-start learns the format and the bias, and RL has something to fix. Test
pictures are fresh drawings (other colours, sizes, offsets) that never occur in train.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from spmdrl.config_section import register_config_section
from spmdrl.data import parquet
from spmdrl.data.images import PLACEHOLDER
from spmdrl.errors import ConfigError
from spmdrl.rewards.tiny import SHAPES_DATA_SOURCE

PREFIX = "tiny_shapes:"
SPLITS = ("train", "test")
FORMAT_VERSION = 1
QUESTION = "How many squares are in the picture?"
INSTRUCTION = "Give the answer after ####."  # the arithmetic task's (spmdrl.data.tiny_task.INSTRUCTION)
SIZE = 64
CELL = SIZE // 2
COLORS = ((220, 30, 30), (30, 60, 220), (20, 160, 40), (230, 140, 0), (140, 40, 180), (0, 0, 0))

SCHEMA = parquet.verl_schema(
    [("split", pa.string()), ("index", pa.int64()), ("question", pa.string())],
    after_prompt=[("images", parquet.IMAGES)],
    trailing=[("response", pa.string())],  # the SFT demonstration
)


@register_config_section("tiny_shapes")
@dataclass
class TinyShapesConfig:
    """The visual task's settings, the config section ``tiny_shapes``."""

    num_train: int = 2000
    num_test: int = 200
    # Fraction of SFT demonstrations whose answer is right; the rest are off by wrong_offset.
    correct_fraction: float = 1.0
    wrong_offset: int = 1
    seed: int = 1234

    def __post_init__(self) -> None:
        if not 0.0 <= self.correct_fraction <= 1.0:
            raise ConfigError(f"tiny_shapes.correct_fraction must be in [0, 1], got {self.correct_fraction}")
        if self.num_train < 1 or self.num_test < 1:
            raise ConfigError("tiny_shapes.num_train and num_test must be >= 1")


def draw(count: int, rng: random.Random) -> bytes:
    """A white picture with ``count`` squares, one in each of ``count`` random cells, as PNG bytes."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(img)
    for cell in rng.sample(range(4), count):
        side = rng.randint(10, 22)
        x = (cell % 2) * CELL + rng.randint(1, CELL - side - 1)
        y = (cell // 2) * CELL + rng.randint(1, CELL - side - 1)
        pen.rectangle([x, y, x + side, y + side], fill=rng.choice(COLORS))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def _row(split: str, index: int, count: int, claimed: int, png: bytes) -> dict:
    return {
        "data_source": SHAPES_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{PLACEHOLDER}{QUESTION} {INSTRUCTION}"}],
        "images": [{"bytes": png, "path": None}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(count)},
        "extra_info": {"split": split, "index": index, "question": QUESTION},
        "response": f"#### {claimed}",
    }


def generate(cfg: TinyShapesConfig) -> tuple[list[dict], list[dict]]:
    """The (train, test) rows for ``cfg``; the same config always gives the same rows (and bytes)."""
    seen: set[bytes] = set()
    test_rng = random.Random(f"tiny_shapes/{cfg.seed}/test")
    test = []
    for i in range(cfg.num_test):
        count = test_rng.randint(1, 4)
        png = draw(count, test_rng)
        seen.add(png)
        test.append(_row("test", i, count, count, png))
    rng = random.Random(f"tiny_shapes/{cfg.seed}/train")
    num_wrong = round((1.0 - cfg.correct_fraction) * cfg.num_train)
    wrong = set(rng.sample(range(cfg.num_train), num_wrong))
    train = []
    while len(train) < cfg.num_train:
        count = rng.randint(1, 4)
        png = draw(count, rng)
        if png in seen:  # never a test picture in train
            continue
        i = len(train)
        train.append(_row("train", i, count, count + cfg.wrong_offset if i in wrong else count, png))
    return train, test


def config_hash(cfg: TinyShapesConfig) -> str:
    key = json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def write_splits(cache_dir: Path, cfg: TinyShapesConfig) -> dict[str, Path]:
    """The split files for ``cfg`` under ``cache_dir/tiny_shapes-<config hash>/``, written if missing (safe
    from every rank at once: each file appears whole or not at all)."""
    split_dir = Path(cache_dir).expanduser() / f"tiny_shapes-{config_hash(cfg)}"
    paths = {split: split_dir / f"{split}.parquet" for split in SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    train, test = generate(cfg)
    return parquet.write_splits({"train": train, "test": test}, split_dir, SCHEMA)


def resolve(name: str, cache_dir: Path, cfg: TinyShapesConfig) -> Path:
    """The generated file of a ``"tiny_shapes:<split>"`` name."""
    split = name.removeprefix(PREFIX)
    if split not in SPLITS:
        raise ValueError(
            f"data file {name!r}: the built-in visual task has no split {split!r}; use one of "
            f"{', '.join(PREFIX + s for s in SPLITS)} in data.train_files / data.val_files"
        )
    return write_splits(cache_dir, cfg)[split]
