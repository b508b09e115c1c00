"""Run a process as a less capable x86 CPU would: ``SPMDRL_CPU_KIND=avx2|avx512|avx512_bf16``.

What the rollout engine does on a CPU is decided from the CPU's flags, in several libraries:

- spmdrl's ``rollout.dtype=auto`` (bf16 only where the CPU computes it natively) and the tests' choice
  of which GEMM paths this CPU can run (``spmdrl.rollout.cpu_gemm``);
- vLLM: which kernel library it loads (``_C_AVX2``, ``_C_AVX512`` or ``_C``), whether it runs on its
  AMD Zen platform (zentorch GEMMs) or the plain CPU one, whether sgl's AMX kernels apply;
- PyTorch's own kernels (``ATEN_CPU_CAPABILITY``) and oneDNN's (``ONEDNN_MAX_CPU_ISA``).

A machine of one kind therefore runs only its own paths. :func:`emulate` makes this process answer every
one of those questions as a CPU of that kind would: the Python-level detection functions
(``torch.cpu._is_*_supported``, vLLM's Zen check) are replaced, and the two library variables are set for
the kernels (they must also be in the environment before the process starts, for the kernels already
dispatched). The kernels then really run with the narrower instruction set; only CPUID itself is not
faked, so a library that reads it directly (zentorch's own bf16 check) still sees the host. A kind can
only narrow the host: emulating a feature the CPU lacks would crash in the kernel, so it is refused.

A process started with :func:`environment`'s variables emulates the kind from its first line, before
anything can import vLLM: they put :data:`SITE_DIR` on ``PYTHONPATH``, whose ``sitecustomize`` Python runs
at start-up, and that calls :func:`apply_from_env`. The test suite's ``--cpu-kind`` puts them in its own
environment (``tests/conftest.py``), so every process a test starts (torchrun jobs and their ranks, the
fork server the ranks are forked from, spawned ranks, subprocesses) runs as that kind; the fork server
also applies it itself (:mod:`spmdrl.testing.prefork_imports`). A library process (``import spmdrl``)
never emulates.

This is how the test suite covers the three kinds CI and users run on from any one machine
(``.ci/run``; ``docs/testing.md``), and how a developer reproduces a report from another kind of CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

ENV_VAR = "SPMDRL_CPU_KIND"
# The folder of the sitecustomize that applies $SPMDRL_CPU_KIND when a process starts.
SITE_DIR = str(Path(__file__).parent / "cpu_kind_site")


@dataclass(frozen=True)
class CpuKind:
    """The flags of one CPU kind that the libraries above read, and the ISA caps for its kernels."""

    name: str
    avx512: bool
    avx512_bf16: bool
    amx: bool
    aten_capability: str  # ATEN_CPU_CAPABILITY
    onednn_max_isa: str  # ONEDNN_MAX_CPU_ISA


KINDS = {
    # A laptop, or an AMD EPYC before Zen 4: vLLM loads _C_AVX2, spmdrl's engine runs float32.
    "avx2": CpuKind("avx2", False, False, False, "avx2", "AVX2"),
    # Intel Skylake-SP / Cascade Lake: AVX-512 without native bf16 (float32 engine, vLLM's _C_AVX512).
    "avx512": CpuKind("avx512", True, False, False, "avx512", "AVX512_CORE_VNNI"),
    # AMD Zen 4/5 (or Intel Cooper Lake): native bf16 without AMX; a bf16 engine, zentorch on AMD.
    "avx512_bf16": CpuKind("avx512_bf16", True, True, False, "avx512", "AVX512_CORE_BF16"),
}

# The host's real flags, read before any replacement.
_HOST = {
    "avx512": bool(torch.cpu._is_avx512_supported()),
    "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
    "amx": bool(torch.cpu._is_amx_tile_supported()),
}
_active: CpuKind | None = None


class CpuKindError(RuntimeError):
    pass


def host_kind() -> str:
    """The most capable kind in :data:`KINDS` this host is (``amx`` hosts report ``avx512_bf16``)."""
    if _HOST["avx512_bf16"]:
        return "avx512_bf16"
    return "avx512" if _HOST["avx512"] else "avx2"


def runnable_kinds() -> list[str]:
    """The kinds this host can run as: itself and every narrower one."""
    order = list(KINDS)
    return order[: order.index(host_kind()) + 1]


def active() -> CpuKind | None:
    """The kind this process emulates (None: the host's own)."""
    return _active


def environment(kind: str) -> dict[str, str]:
    """The variables a child process needs to start as ``kind``: the kind, the kernels' ISA caps (read at
    start), and ``PYTHONPATH`` with :data:`SITE_DIR` first (this process's ``PYTHONPATH`` after it), whose
    sitecustomize applies the kind before the process runs anything else."""
    k = _lookup(kind)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    return {
        ENV_VAR: k.name,
        "ATEN_CPU_CAPABILITY": k.aten_capability,
        "ONEDNN_MAX_CPU_ISA": k.onednn_max_isa,
        "PYTHONPATH": os.pathsep.join([SITE_DIR, *path]),
    }


def _lookup(kind: str) -> CpuKind:
    if kind not in KINDS:
        raise CpuKindError(f"{ENV_VAR}={kind!r} is not one of {', '.join(KINDS)}")
    if kind not in runnable_kinds():
        raise CpuKindError(
            f"{ENV_VAR}={kind}: this CPU is {host_kind()} and cannot run as a more capable kind "
            f"(it can run as {', '.join(runnable_kinds())})"
        )
    return KINDS[kind]


def emulate(kind: str) -> CpuKind:
    """Make this process detect ``kind``'s flags (call before vLLM is imported; idempotent)."""
    global _active
    k = _lookup(kind)
    for var, value in environment(kind).items():
        os.environ[var] = value
    flags = {"avx512": k.avx512, "avx512_bf16": k.avx512_bf16, "amx": k.amx}
    torch.cpu._is_avx512_supported = lambda: flags["avx512"]  # type: ignore[attr-defined]
    torch.cpu._is_avx512_bf16_supported = lambda: flags["avx512_bf16"]  # type: ignore[attr-defined]
    torch.cpu._is_avx512_vnni_supported = lambda: flags["avx512"]  # type: ignore[attr-defined]
    torch.cpu._is_amx_tile_supported = lambda: flags["amx"]  # type: ignore[attr-defined]
    torch.cpu._is_amx_fp16_supported = lambda: flags["amx"]  # type: ignore[attr-defined]
    if "vllm.platforms" in sys.modules:
        if getattr(sys.modules["vllm.platforms"], "_current_platform", None) is not None:
            raise CpuKindError(f"{ENV_VAR}={kind}: vLLM chose its platform before the emulation started")
        _patch_vllm_platforms(sys.modules["vllm.platforms"], k)
    else:
        sys.meta_path.insert(0, _PlatformsHook(k))
    _active = k
    return k


def _patch_vllm_platforms(module: ModuleType, kind: CpuKind) -> None:
    # vLLM runs on its Zen platform (zentorch GEMMs) on an AMD CPU with AVX-512. The AVX-512 kinds without
    # bf16 are Intel's; an AVX2 CPU is never taken for Zen. Only the host's own kind keeps the host's answer.
    if kind.name != host_kind():
        module._is_amd_zen_cpu = lambda: False  # type: ignore[attr-defined]


class _PlatformsHook(importlib.abc.MetaPathFinder):
    """Patches ``vllm.platforms`` the moment it is imported, before it resolves the current platform."""

    def __init__(self, kind: CpuKind) -> None:
        self.kind = kind

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "vllm.platforms":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, kind = spec.loader, self.kind

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):  # type: ignore[no-untyped-def]
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                _patch_vllm_platforms(module, kind)

        spec.loader = _Loader()
        return spec


def apply_from_env() -> None:
    """Emulate ``$SPMDRL_CPU_KIND`` if it is set (the sitecustomize in :data:`SITE_DIR` and the tests' fork
    server call this before anything imports vLLM)."""
    kind = os.environ.get(ENV_VAR, "")
    if kind and _active is None:
        emulate(kind)
