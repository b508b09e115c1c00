"""spmdrl.testing.cpu_kind end to end: a process started as a narrower CPU kind loads that kind's vLLM
library and makes that kind's choices, and a test's torchrun job runs every rank as the kind."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmdrl.testing import cpu_kind
from spmdrl.testing.launch import torchrun

PROBE = """
import json
import torch
from spmdrl.rollout import cpu_gemm
from spmdrl.rollout.vllm_plan import resolve_engine_dtype
from vllm.platforms import current_platform
current_platform.import_kernels()
libs = sorted({l.split()[-1].rsplit("/", 1)[-1] for l in open("/proc/self/maps") if "vllm/_C" in l})
print(json.dumps({
    "auto_dtype": str(resolve_engine_dtype("auto", "cpu")),
    "zen": current_platform.is_zen_cpu(),
    "libs": libs,
    "aten": torch.backends.cpu.get_cpu_capability(),
    "zentorch_bf16": cpu_gemm.unavailable_reason("zentorch", torch.bfloat16),
}))
"""


EXPECTED = {
    # kind: (auto engine dtype, vLLM's kernel library, ATen's capability)
    "avx2": ("torch.float32", "_C_AVX2.abi3.so", "AVX2"),
    "avx512": ("torch.float32", "_C_AVX512.abi3.so", "AVX512"),
    "avx512_bf16": ("torch.bfloat16", "_C.abi3.so", "AVX512"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(cpu_kind.KINDS))
def test_a_process_started_as_a_kind_runs_that_kinds_libraries(kind: str) -> None:
    if kind not in cpu_kind.runnable_kinds():
        pytest.skip(f"this {cpu_kind.host_kind()} CPU cannot run as {kind} (a kind only narrows the host)")
    env = {**os.environ, **cpu_kind.environment(kind), "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    dtype, lib, aten = EXPECTED[kind]
    assert got["auto_dtype"] == dtype, got
    assert got["libs"] == [lib], got
    assert got["aten"] == aten, got
    if kind != cpu_kind.host_kind():
        # vLLM's Zen platform (zentorch GEMMs) is for AMD CPUs with AVX-512 and bf16: never these kinds.
        assert got["zen"] is False, got
    if dtype == "torch.float32" and importlib.util.find_spec("zentorch") is not None:
        # (Without zentorch, the cpu-amd extra, the reason given is its absence: tests/unit/rollout.)
        assert "needs a CPU with AVX512-BF16" in (got["zentorch_bf16"] or ""), got


RANK_PROBE = """
import os
from spmdrl.testing import cpu_kind
print("KIND", os.environ["RANK"], getattr(cpu_kind.active(), "name", None))
"""


@pytest.mark.slow
def test_a_torchrun_jobs_ranks_run_as_the_kind(tmp_path: Path) -> None:
    """A job started the way the tests start theirs (spmdrl.testing.launch.torchrun), with the kind's
    environment: torchrun starts each rank as a fresh interpreter, which emulates the kind from its start."""
    kind = cpu_kind.runnable_kinds()[0]  # every host runs as the narrowest kind
    script = tmp_path / "probe.py"
    script.write_text(RANK_PROBE)
    res = torchrun([str(script)], nproc=2, env=cpu_kind.environment(kind), timeout_s=300)
    assert res.returncode == 0, res.output[-3000:]
    lines = sorted(line for line in res.output.splitlines() if line.startswith("KIND"))
    assert lines == [f"KIND 0 {kind}", f"KIND 1 {kind}"], res.output[-3000:]
