"""spmdrl.cpu_kind: the environment a kind sets, and kinds that are refused."""

from __future__ import annotations

import pytest

from spmdrl import cpu_kind


def test_environment_names_the_kind_and_caps_the_kernels() -> None:
    env = cpu_kind.environment("avx2")
    assert env == {"SPMDRL_CPU_KIND": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_unknown_or_more_capable_kinds_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(cpu_kind.CpuKindError, match="'avx3' is not one of avx2, avx512, avx512_bf16"):
        cpu_kind.environment("avx3")
    # An AVX2-only host cannot run AVX-512 instructions, so it cannot pretend to.
    monkeypatch.setattr(cpu_kind, "_HOST", {"avx512": False, "avx512_bf16": False, "amx": False})
    assert cpu_kind.runnable_kinds() == ["avx2"]
    with pytest.raises(cpu_kind.CpuKindError, match="this CPU is avx2 and cannot run as a more capable kind"):
        cpu_kind.emulate("avx512")
