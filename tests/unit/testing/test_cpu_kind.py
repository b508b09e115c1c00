"""spmdrl.testing.cpu_kind: the environment a kind sets, kinds that are refused, and the start-up hook that
makes a process started with that environment emulate the kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spmdrl.testing import cpu_kind

PROBE = """
import json, sys
import torch
from spmdrl.testing import cpu_kind
print(json.dumps({
    "active": getattr(cpu_kind.active(), "name", None),
    "vllm_hook": any(isinstance(f, cpu_kind._PlatformsHook) for f in sys.meta_path),
    "avx512": torch.cpu._is_avx512_supported(),
}))
"""


def test_environment_names_the_kind_caps_the_kernels_and_installs_the_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", cpu_kind.SITE_DIR]))
    env = cpu_kind.environment("avx2")
    assert env == {
        "SPMDRL_CPU_KIND": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        # The hook's folder first, once; the rest of the path kept.
        "PYTHONPATH": os.pathsep.join([cpu_kind.SITE_DIR, "/elsewhere"]),
    }


def test_unknown_or_more_capable_kinds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(cpu_kind.CpuKindError, match="'avx3' is not one of avx2, avx512, avx512_bf16"):
        cpu_kind.environment("avx3")
    # An AVX2-only host cannot run AVX-512 instructions, so it cannot pretend to.
    monkeypatch.setattr(cpu_kind, "_HOST", {"avx512": False, "avx512_bf16": False, "amx": False})
    assert cpu_kind.runnable_kinds() == ["avx2"]
    with pytest.raises(cpu_kind.CpuKindError, match="this CPU is avx2 and cannot run as a more capable kind"):
        cpu_kind.emulate("avx512")


@pytest.mark.parametrize("hook", [True, False], ids=["test-launcher", "library"])
def test_a_process_emulates_only_when_started_with_the_kinds_environment(hook: bool) -> None:
    """The tests start their processes with :func:`environment` (tests/conftest.py): such a process emulates
    the kind from its start, before it imports anything of its own. A process that only has
    SPMDRL_CPU_KIND (``import spmdrl``, a user's job) does not: the emulation is the tests' own. AVX2 is a
    kind every host can run as; on an AVX2-only host its flags equal the host's, so the probe reads
    whether the emulation is active, and the import hook it leaves for vLLM's platform choice."""
    env = {**os.environ, **cpu_kind.environment("avx2")}
    if not hook:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in env["PYTHONPATH"].split(os.pathsep) if p != cpu_kind.SITE_DIR
        )
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if hook:
        assert got == {"active": "avx2", "vllm_hook": True, "avx512": False}, got
    else:
        assert got["active"] is None and not got["vllm_hook"], got
