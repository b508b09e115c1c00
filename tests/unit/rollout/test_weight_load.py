"""rollout.weight_load: which load a built engine uses, and the setting refused where it cannot work
(tests/integration/test_weight_load_direct.py runs the direct load into the real engine)."""

from __future__ import annotations

import pytest

from spmdrl.config import ConfigError, RolloutConfig
from spmdrl.rollout.engine import check_engine_config
from spmdrl.rollout.vllm_plan import resolve_weight_load


def test_auto_loads_directly_where_the_kernels_read_the_parameters() -> None:
    assert resolve_weight_load("auto", "cuda", {}) == "direct"
    assert resolve_weight_load("auto", "cpu", {"torch": 9}) == "direct"
    assert resolve_weight_load("auto", "cpu", {"torch": 8, "none": 1}) == "direct"
    # A packed CPU path computes from a copy only vLLM's re-processing reload rebuilds.
    assert resolve_weight_load("auto", "cpu", {"onednn": 8, "torch": 1}) == "reload"
    assert resolve_weight_load("auto", "cpu", {"sgl": 9}) == "reload"
    assert resolve_weight_load("reload", "cuda", {}) == "reload"
    assert resolve_weight_load("reload", "cpu", {"torch": 9}) == "reload"
    assert resolve_weight_load("direct", "cpu", {"torch": 9}) == "direct"
    # A quantized checkpoint's kernels compute from vLLM's processed weights.
    assert resolve_weight_load("auto", "cuda", {}, quantized=True) == "reload"


def test_direct_on_a_packed_cpu_path_is_refused() -> None:
    with pytest.raises(ConfigError, match="rollout.cpu_gemm=torch"):
        resolve_weight_load("direct", "cpu", {"onednn": 9})
    with pytest.raises(ConfigError, match="quantized"):
        resolve_weight_load("direct", "cuda", {}, quantized=True)
    # Before any engine is built, from the config alone.
    with pytest.raises(ConfigError, match="rollout.weight_load=direct on CPU needs rollout.cpu_gemm=torch"):
        check_engine_config(RolloutConfig(weight_load="direct", cpu_gemm="auto"), "cpu")
    check_engine_config(RolloutConfig(weight_load="direct", cpu_gemm="torch"), "cpu")
    check_engine_config(RolloutConfig(weight_load="direct"), "cuda")


def test_an_unknown_setting_is_a_config_error() -> None:
    from spmdrl.config_loader import load_config

    with pytest.raises(ConfigError, match="weight_load"):
        load_config(["recipe=grpo_tiny", "rollout.weight_load=fast"])


def test_a_mixture_of_experts_on_cpu_reloads_its_prepacked_experts() -> None:
    """vLLM's CPU fused-MoE kernel computes from prepacked experts (cpu_gemm.gemm_paths counts its layers
    as moe_prepacked), even where every linear layer is on the torch path: reload, and direct is refused."""
    paths = {"torch": 20, "moe_prepacked": 4}
    assert resolve_weight_load("auto", "cpu", paths) == "reload"
    with pytest.raises(ConfigError, match="fused-MoE layers compute from prepacked expert weights"):
        resolve_weight_load("direct", "cpu", paths)
