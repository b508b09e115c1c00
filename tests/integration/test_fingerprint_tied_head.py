"""spmdrl/rollout/fingerprint.py on a real vLLM engine: a tied LM head that is the embedding module itself
(vLLM 0.24's Qwen2) fingerprints as the 0.32 head that shares the embedding's weight. (Moved from the unit
tier, which tests the fingerprint on tensors: tests/unit/rollout/test_fingerprint.py.)"""

from __future__ import annotations

import pytest
import torch


def _tied_as_one_module(rank: int, world: int, model_dir: str) -> tuple[dict, dict]:
    """The engine's fingerprint of the real model (0.32: a ParallelLMHead sharing the embedding's
    weight) and of the same model re-wired the way vLLM 0.24's Qwen2 ties (lm_head = the embedding
    module itself): they must agree, since the trainer counts the embedding once per engine layer."""
    from pathlib import Path
    from types import SimpleNamespace

    from spmdrl.config import RolloutConfig
    from spmdrl.rollout import vllm_worker
    from spmdrl.rollout.engine import build_engine

    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, dtype="float32", cpu_gemm="torch"),
        max_model_len=64,
        device_type="cpu",
    )

    def both(worker):  # noqa: ANN001, ANN202
        real = worker.model_runner.get_model()
        rewired = torch.nn.Module()
        rewired.model = real.model
        rewired.lm_head = real.model.embed_tokens
        fake = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: rewired))
        return (
            vllm_worker.fingerprint(worker, 3, 0, torch.float32).values,
            vllm_worker.fingerprint(fake, 3, 0, torch.float32).values,
        )

    out = engine.llm.collective_rpc(both)[0]
    engine.close()
    return out


def test_tied_lm_head_that_is_the_embedding_module_counts_twice(tmp_path) -> None:  # noqa: ANN001
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.testing.spawn import run_distributed

    model_dir = str(ensure_tiny_model(tmp_path))
    real, rewired = run_distributed(_tied_as_one_module, 1, model_dir, timeout_s=300)[0]
    assert real.keys() == rewired.keys()
    for key in real:
        for a, b in zip(real[key], rewired[key], strict=True):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), key
