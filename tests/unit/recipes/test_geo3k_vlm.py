"""The GPU recipe for Geometry3K with a vision-language model (configs/recipe/grpo_geo3k_vlm.yaml) passes
``--check`` on 8 ranks without a download: its model a local directory holding an Idefics3 config (what
SmolVLM's checkpoint says of itself), its data verl-schema parquet with an images column, as
recipes/geo3k_prep.py writes it from the hub's rows; and the same recipe with packed sequences is refused."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from spmdrl.recipes.geo3k_prep import SCHEMA, convert
from spmdrl.train import parse_config

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "recipe" / "grpo_geo3k_vlm.yaml"


def _hub_rows(n: int) -> list[dict]:
    img = Image.new("RGB", (40, 40), "white")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return [
        {
            "images": [img if i % 2 else {"bytes": buf.getvalue(), "path": None}],
            "problem": f"Find x{i}.",
            "answer": "3",
        }
        for i in range(n)
    ]


def _setup(tmp_path: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = []
    for split, n in (("train", 512), ("test", 16)):  # one global batch (trainer.global_batch_size=512)
        rows = convert(_hub_rows(n), split)
        assert rows[0]["prompt"][0]["content"].startswith("<image>Find x0.")
        path = tmp_path / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
        files.append(str(path))
    model = tmp_path / "smolvlm"
    model.mkdir()
    # SmolVLM-Instruct's decoder: 16k positions, 32 heads (what the start's shape checks read).
    text = {
        "model_type": "llama",
        "max_position_embeddings": 16384,
        "num_attention_heads": 32,
        "vocab_size": 49155,
    }
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "text_config": text,
    }
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    return [f"model.path={model}", f"data.train_files=[{files[0]}]", f"data.val_files=[{files[1]}]"]


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        parse_config([f"recipe={RECIPE}", *args, "--check", "--world-size", "8"])
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_the_geo3k_recipe_checks_without_a_download(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _setup(tmp_path)
    code, out, err = _check(capsys, *args)
    assert code == 0, err
    assert "is a vision-language model" in out and "hiyouga/geometry3k" in out, out
    code, out, err = _check(capsys, *args, "trainer.pack_sequences=true")
    assert code == 2 and "trainer.pack_sequences=true" in err and "vision-language model" in err, err
