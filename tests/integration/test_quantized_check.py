"""The weight-sync check at a quantized engine's tolerance (rollout.quantization=fp8 raises it to
spmdrl.rollout.quantization.FP8_CHECK_TOL) still catches a wrong or stale weight, on the real engine.

fp8 itself cannot run here (vLLM's CPU build has no fp8 kernels: tests/unit/rollout/test_quantization.py
checks the refusal); the fp8 engine's own verdicts, clean and corrupted, are measured on a GPU by
benchmarks/rollout_quant.py. What this test holds is that the looser comparison keeps its teeth: a bf16
engine, checked at the fp8 tolerance, passes a clean sync and fails one with a tensor doubled, and one in
which a tensor never arrived (the engine kept its checkpoint value while training moved the trainer's). A
stale tensor whose values moved by less than fp8's rounding passes at this tolerance: what the check can
and cannot see is in docs/rollout.md#low-precision-rollout."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.config import RolloutConfig
from spmdrl.testing.spawn import run_distributed

# The bf16 engine's GEMM path (and so what its kernels return) depends on the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
DOUBLED = "model.layers.2.mlp.down_proj.weight"
STALE = "model.layers.1.self_attn.o_proj.weight"


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.fingerprint import WeightSyncError
    from spmdrl.rollout.quantization import FP8_CHECK_TOL
    from spmdrl.rollout.weight_sync import SyncCheck, sync_weights
    from tests.integration.test_weight_sync import _fsdp_actor, _perturb

    model, originals, _ = _fsdp_actor(rank, world, model_dir)
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, max_num_seqs=8, seed=0, dtype="bfloat16"),
        max_model_len=128,
        device_type="cpu",
    )
    out: dict = {}
    load = engine.load_weights

    def verdict(seed: int, change=None) -> str:  # noqa: ANN001
        if change is not None:
            engine.load_weights = lambda ws: load(change(n, t) for n, t in ws)
        try:
            sync_weights(model, engine, check=SyncCheck(seed=seed, tol=FP8_CHECK_TOL))
            return "passed"
        except WeightSyncError as e:
            return str(e)
        finally:
            engine.load_weights = load

    try:
        checkpoint: dict = {}
        verdict(1, lambda n, t: (n, checkpoint.setdefault(n, t.clone()) if n == STALE else t))
        # Training moves every weight (ordinary noise on each, the size of the weights themselves).
        _perturb(model, originals, seed=1)
        out["clean"] = verdict(2)
        out["doubled"] = verdict(3, lambda n, t: (n, t * 2 if n == DOUBLED else t))
        # One tensor never arrives: the engine keeps serving its checkpoint value.
        out["stale"] = verdict(4, lambda n, t: (n, checkpoint[STALE] if n == STALE else t))
        return out
    finally:
        engine.close()


@pytest.mark.guarantee("sync:quantized")
def test_the_quantized_engines_check_tolerance_still_catches_wrong_and_stale_weights(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model

    (r,) = run_distributed(_worker, 1, str(ensure_tiny_model(tmp_path)), timeout_s=600, env=VLLM_ENV)
    assert r["clean"] == "passed", r["clean"]
    assert "layer 2: matrices" in r["doubled"] and DOUBLED in r["doubled"], r["doubled"]
    assert "layer 1: matrices" in r["stale"] and STALE in r["stale"], r["stale"]
