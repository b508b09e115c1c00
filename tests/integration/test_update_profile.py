"""benchmarks/update_profile.py's CPU dry run: the profiler benchmark runs spmdrl's update and no-grad forward
on the tiny shape under FSDP2 (one gloo rank) and writes its figures in bench_report's format; ``--plain``
runs the same work on the bare Hugging Face module from the same weights, whose logprobs must be spmdrl's,
and whose host time in FSDP2's profiler ranges is 0 where spmdrl's is not.

A CPU has no peak in the table, so the run is given one (``--peak-tflops``): the MFU path runs, and its
figure must be the FLOPs of spmdrl.logging.flops over the measured time. ``--set`` turns on activation
checkpointing, which must reach the config the benchmark builds: the hardware FLOPs then exceed the model
FLOPs, which stay 3 x the forward's. A ``model.compile=true`` variant must compile the model's blocks as the
RL job's build does (spmdrl.models.build.parallelize): its update and its no-grad forward run fewer ATen
ops per micro-batch (the fused kernels replace them). An earlier build of the benchmark skipped that step,
and a GPU run measured "compile" as the eager model; and its CPU sync count (a dispatch mode) ran before
the forward was timed, which made dynamo give up on the blocks, so the forward ran eager.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEAK_TFLOPS = 1.0


def _run_profile(tmp_path: Path, *args: str) -> dict:
    """update_profile.py on the tiny shape with ``args``; its JSON document."""
    out = tmp_path / "profile.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "update_profile.py"),
        "--shape=tiny",
        *args,
        f"--json={out}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _figures(doc: dict) -> dict:
    return {f["name"].removeprefix("update_profile/"): f for f in doc["figures"]}


def test_the_profile_dry_run_writes_every_figure(tmp_path: Path) -> None:
    doc = _run_profile(
        tmp_path,
        "--steps=1",
        f"--peak-tflops={PEAK_TFLOPS}",
        "--set=model.activation_checkpointing=full",
        "--variant=compiled=model.compile=true",
        "--plain",
    )
    figs = _figures(doc)
    assert doc["benchmark"] == "update_profile" and doc["device"] == "cpu"
    for name in ("update", "forward"):
        seconds = figs[f"{name}_s"]["value"]
        assert seconds > 0
        assert figs[f"mfu_{name}"]["value"] == pytest.approx(
            doc[f"{name}_model_flops"] / seconds / (PEAK_TFLOPS * 1e12)
        )
        assert figs[f"launches_per_micro_batch_{name}"]["unit"] == "aten ops (CPU proxy)"
        assert figs[f"launches_per_micro_batch_{name}"]["value"] > 0
        # The fixed syncs of a pass (its rows' sizes at least), spread over its micro-batches.
        assert figs[f"syncs_{name}"]["value"] >= 1
        assert figs[f"syncs_per_micro_batch_{name}"]["value"] == pytest.approx(
            figs[f"syncs_{name}"]["value"] / doc[f"{name}_micro_batches"]
        )
        assert f"gpu_busy_{name}" not in figs  # CUDA only
    tokens = doc["rows"] * doc["length"]
    assert figs["tokens_per_s_update"]["value"] == pytest.approx(tokens / figs["update_s"]["value"])
    # One PPO epoch: the update's model FLOPs are 3 forwards; checkpointing adds to the hardware count only.
    assert doc["update_model_flops"] == 3 * doc["forward_model_flops"]
    assert doc["update_hardware_flops"] > doc["update_model_flops"]
    assert figs["hfu_update"]["value"] > figs["mfu_update"]["value"]
    assert doc["activation_checkpointing"] == "full"
    assert doc["update_micro_batches"] == doc["rows"] // doc["micro_batch_size"]
    # CPU: sequence-count micro-batches (token budgets come from a CUDA card's memory only).
    assert doc["update_token_budget"] == 0 and doc["no_grad_token_budget"] == 0
    # --plain: the same work on the bare module, from the same weights: it scores the same tokens alike.
    assert figs["plain/logprob_max_abs_diff"]["value"] < 1e-4
    for name in ("update", "forward"):
        plain = figs[f"plain/{name}_s"]
        assert plain["value"] > 0 and plain["baseline"] == figs[f"{name}_s"]["value"]
        assert figs[f"plain/launches_per_micro_batch_{name}"]["value"] > 0
        # Host time by part: FSDP2's ranges in spmdrl's passes (its gather at least), none on the bare module.
        assert 0 < figs[f"fsdp_host_s_{name}"]["value"] < figs[f"{name}_s"]["value"] * 10
        assert 0 < figs[f"fsdp_host_share_{name}"]["value"] < 1
        assert figs[f"plain/fsdp_host_s_{name}"]["value"] == 0
    # The optimizer's step and zero_grad run in the update only, in both columns.
    for column in ("", "plain/"):
        assert figs[f"{column}optimizer_host_s_update"]["value"] > 0
        assert figs[f"{column}optimizer_host_s_forward"]["value"] == 0
    for name in ("update", "forward"):  # the no-grad pass too (it compiles again, without autograd)
        compiled = figs[f"compiled/launches_per_micro_batch_{name}"]
        assert compiled["baseline"] == figs[f"launches_per_micro_batch_{name}"]["value"]
        assert compiled["value"] < 0.9 * compiled["baseline"], (name, compiled)


def test_a_negative_micro_batch_is_refused_before_any_work(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "update_profile.py"), "--shape=tiny", "--micro=-2"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--micro -2: sequences per micro-batch must be > 0" in proc.stderr


def test_interleaved_columns_each_get_their_figures(tmp_path: Path) -> None:
    """--interleave builds every column first and times them in turn: each still gets its own figures.
    The variant reduces the gradients after every micro-batch (trainer.defer_grad_sync=false), which on
    one rank auto defers: more ATen ops per update micro-batch, the same no-grad pass. The bare module
    (model.fsdp_unit=none) runs fewer ATen ops than FSDP2's one-rank unit in both passes, none of its host
    time in FSDP2."""
    figs = _figures(
        _run_profile(
            tmp_path,
            "--steps=2",
            "--interleave",
            "--plain",
            "--variant=reduce_each=trainer.defer_grad_sync=false",
            "--variant=bare=model.fsdp_unit=none",
        )
    )
    for name in ("update", "forward"):
        bare = figs[f"bare/launches_per_micro_batch_{name}"]
        assert bare["value"] < bare["baseline"], (name, bare)
        assert figs[f"bare/fsdp_host_s_{name}"]["value"] == 0 < figs[f"fsdp_host_s_{name}"]["value"]
    for column in ("reduce_each", "bare", "plain"):
        for name in ("update", "forward"):
            assert figs[f"{column}/{name}_s"]["value"] > 0
            assert figs[f"{column}/{name}_s"]["baseline"] == figs[f"{name}_s"]["value"]
    each = figs["reduce_each/launches_per_micro_batch_update"]
    assert each["value"] > each["baseline"]
    forward = figs["reduce_each/launches_per_micro_batch_forward"]
    assert forward["value"] == forward["baseline"]
    assert figs["plain/logprob_max_abs_diff"]["value"] < 1e-4
