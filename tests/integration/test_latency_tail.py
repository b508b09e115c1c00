"""The latency tail's Rollout wrapper through a real engine (spmdrl/testing/latency_tail.py): the same seeded
call through a Rollout without the tail, with it (a training call) and as a validation call; the choice of
slow prompts, the checks and the launcher are unit-tested (tests/unit/testing/test_latency_tail.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spmdrl.rollout.config import RolloutConfig
from spmdrl.testing.latency_tail import LatencyTail, LatencyTailRollout, slow_prompts

# Long enough that an engine call of a few tokens never takes as long, even on a loaded machine.
TAIL_S = 5.0


def _tail_worker(rank: int, world: int, model_dir: str) -> dict:
    """One real engine on one rank: the same seeded call through a Rollout without a tail, with one, and
    as a validation call with one; the seconds each took and what take_metrics reported after it."""
    import torch

    from spmdrl.data.prompts import PromptExample
    from spmdrl.rollout.engine import SamplingSpec, build_engine, request_seed
    from spmdrl.rollout.rollout import Rollout

    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, max_num_seqs=16),
        max_model_len=64,
        device_type="cpu",
    )
    prompts = [PromptExample(i, [1, 10 + i, 20, 30], [], "", "t", {}) for i in range(4)]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=6, seed=42)
    device = torch.device("cpu")
    plain = Rollout(engine)
    tailed = LatencyTailRollout(Rollout(engine), LatencyTail(prompts=1, seconds=TAIL_S))
    plain.generate(prompts, spec)  # warm-up: the first call compiles and caches
    out: dict = {}
    for name, rollout, training in (("plain", plain, True), ("tail", tailed, True), ("val", tailed, False)):
        t0 = time.perf_counter()
        gens = rollout.generate(prompts, spec, training=training)
        out[name] = dict(
            seconds=time.perf_counter() - t0,
            tokens=[g.token_ids for g in gens],
            metrics=rollout.take_metrics(device),
            slow=list(getattr(rollout, "last_slow_prompts", [])),
        )
    out["expected_slow"] = slow_prompts(4, 1, request_seed(42, engine.groups.dp_index))
    engine.close()
    return out


@pytest.mark.slow
def test_a_training_call_waits_the_tail_and_a_validation_call_does_not(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.testing.spawn import run_distributed

    model_dir = str(ensure_tiny_model(tmp_path))
    out = run_distributed(_tail_worker, 1, model_dir, timeout_s=300, env={"VLLM_LOGGING_LEVEL": "WARNING"})[0]
    plain, tail, val = out["plain"], out["tail"], out["val"]
    # The tail only delays the call: the same seeded samples come back.
    assert plain["tokens"] == tail["tokens"] == val["tokens"]
    # The engine's own time varies by seconds on a shared CPU: the tail call is not compared with the plain
    # one, only with what the tail alone must add.
    assert tail["seconds"] >= TAIL_S, out
    assert tail["metrics"]["rollout/wait_s"] >= TAIL_S
    assert tail["slow"] == out["expected_slow"] and len(tail["slow"]) == 1
    # Validation is never slowed, and reports no tail; a Rollout without one reports nothing.
    assert val["seconds"] < TAIL_S, out
    assert val["metrics"] == {} and plain["metrics"] == {}
