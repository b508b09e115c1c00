"""The CPU GEMM paths (spmdrl/rollout/cpu_gemm.py): the ones this CPU can run pass the check; the others
are refused at config check with the reason."""

from __future__ import annotations

import pytest
import torch

from spmdrl.config import ConfigError, RolloutConfig

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds

# ---- every CPU GEMM path vLLM can pick, forced, in bf16 and fp32 engines ----------------------------

# (rollout.cpu_gemm, rollout.dtype): each path vLLM 0.32 can give a linear layer on CPU, for both engine
# dtypes it serves (sgl has no fp32 kernel). Forced, so every machine tests every path it can run.
CPU_GEMM_CASES = [
    ("torch", "bfloat16"),
    ("onednn", "bfloat16"),
    ("sgl", "bfloat16"),
    ("zentorch", "bfloat16"),
    ("torch", "float32"),
    ("onednn", "float32"),
    ("zentorch", "float32"),
]


def _unavailable(path: str, dtype: str | None = None) -> str | None:
    """Why this machine cannot run ``path`` (None: it can): the library's own answer, the one the engine's
    config check gives (so a path the CPU lacks is skipped here for the reason a user would be told)."""
    from spmdrl.rollout.cpu_gemm import unavailable_reason

    return unavailable_reason(path, None if dtype is None else getattr(torch, dtype))


@pytest.mark.parametrize("path", ["torch", "onednn", "sgl", "zentorch"])
def test_cpu_gemm_path_runs_here(path: str) -> None:
    """The paths the matrix above skips, with the reason; the others pass the engine's own check."""
    reason = _unavailable(path)
    if reason is not None:
        pytest.skip(reason)
    from spmdrl.rollout.cpu_gemm import check_available

    check_available(path)


@pytest.mark.parametrize(("path", "dtype"), CPU_GEMM_CASES)
def test_unavailable_paths_are_refused_at_config_check(path: str, dtype: str) -> None:
    """A (path, dtype) this CPU cannot run fails the engine's config check with the reason, before any
    engine is built (zentorch's bf16 kernel would otherwise abort at the first matmul on an AVX2 CPU)."""
    from spmdrl.rollout.engine import check_engine_config

    cfg = RolloutConfig(cpu_gemm=path, dtype=dtype)
    reason = _unavailable(path, dtype)
    if reason is None:
        check_engine_config(cfg, "cpu")
    else:
        with pytest.raises(ConfigError, match="needs"):
            check_engine_config(cfg, "cpu")
