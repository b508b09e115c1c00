"""The GPU-path bookkeeping of the vLLM engine, tested on CPU without building vLLM.

The supported-version check is a function of a version string. Sleep levels, weight validity and close's
wake-first run against a stand-in for ``vllm.LLM`` that records calls. The process-settings swap runs in
a child process: it sets torch's global matmul precision, which must not leak into other tests.
"""

from __future__ import annotations

import sys
import textwrap
import types
from typing import Any

import pytest
import torch

from spmdrl.rollout.engine_ranks import EngineWorld
from spmdrl.rollout.groups import TPGroups
from spmdrl.rollout.vllm_engine import VLLMEngine
from spmdrl.testing.spawn import run_distributed

# Its outcome depends on the kernels the engine picks for the CPU: CI runs it as every CPU kind.
pytestmark = pytest.mark.cpu_kinds

# ---- sleep levels, weight validity, close --------------------------------------------------------------


class _FakeLLM:
    """Records the calls the engine makes on ``vllm.LLM`` (in order)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.shut_down = False
        executor = types.SimpleNamespace(shutdown=lambda: self.calls.append(("executor.shutdown", None)))
        scheduler = types.SimpleNamespace(shutdown=lambda: self.calls.append(("scheduler.shutdown", None)))
        core = types.SimpleNamespace(model_executor=executor, scheduler=scheduler)
        # vLLM 0.24's in-process client: no _finalizer.
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=core))

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", list(tags)))

    def collective_rpc(self, fn: Any, args: tuple = ()) -> list[Any]:
        self.calls.append(("collective_rpc", getattr(fn, "__name__", fn)))
        list(args[0])  # the reload consumes the weights iterator
        return [[]]

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        return True


def _engine(device_type: str = "cuda", free_cache_engine: bool = True) -> tuple[VLLMEngine, _FakeLLM]:
    """A VLLMEngine around a _FakeLLM, with the attributes __init__ sets before building vLLM."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.device_type = device_type
    engine.groups = TPGroups(1)
    engine.world = EngineWorld.everywhere()  # every rank: nothing swapped around vLLM's calls
    engine.sleep_enabled = device_type == "cuda" and free_cache_engine
    engine._sleeping = set()
    engine._weights_discarded = False
    engine._warned_no_sleep = False
    engine.image_token_ids = []  # a text model
    engine.expected_weights = {"w"}
    engine.weight_load = "direct" if device_type == "cuda" else "reload"  # rollout.weight_load=auto's choice
    engine.llm = fake = _FakeLLM()
    return engine, fake


def _load(engine: VLLMEngine) -> None:
    engine.load_weights(iter([("w", torch.zeros(2))]))


def test_sleep_without_keeping_weights_discards_them_until_a_load() -> None:
    engine, fake = _engine()
    engine.sleep(keep_weights=False)
    assert fake.calls == [("sleep", 2)]
    # Nothing may generate from discarded weights, and the refusal comes before any engine call.
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        engine.generate([[1, 2]], _spec())
    assert fake.calls == [("sleep", 2)]
    # Waking everything does not bring them back: only a load does.
    engine.wake_up()
    with pytest.raises(RuntimeError, match="with no load_weights since"):
        engine.generate([[1, 2]], _spec())
    _load(engine)
    engine._require_weights("generate")  # what generate checks first


def test_a_failed_load_leaves_the_weights_invalid() -> None:
    engine, _ = _engine()
    with pytest.raises(RuntimeError, match="left 1 engine weights at their old values"):
        engine.load_weights(iter([("not_w", torch.zeros(2))]))
    with pytest.raises(RuntimeError, match="the last load_weights failed"):
        engine._require_weights("generate")
    _load(engine)
    engine._require_weights("generate")


def test_load_wakes_only_the_weights_and_then_generate_may_run() -> None:
    engine, fake = _engine()
    engine.sleep(keep_weights=False)
    _load(engine)
    wakes = [c for c in fake.calls if c[0] == "wake_up"]
    assert wakes == [("wake_up", ["weights"])]  # the KV cache stays asleep through the sync
    assert fake.calls[-1] == ("reset_prefix_cache", None)
    engine._require_weights("generate")
    assert engine._sleeping == {"kv_cache"}


def test_sleep_keeping_weights_uses_level_1_and_generate_stays_allowed() -> None:
    engine, fake = _engine()
    engine.sleep()
    assert fake.calls == [("sleep", 1)]
    engine._require_weights("generate")
    engine.sleep(keep_weights=False)  # already asleep: nothing more to free, the host copy stays valid
    assert fake.calls == [("sleep", 1)]
    engine._require_weights("generate")


@pytest.mark.parametrize(("device_type", "free_cache_engine"), [("cpu", True), ("cuda", False)])
def test_sleep_is_a_no_op_where_disabled(device_type: str, free_cache_engine: bool) -> None:
    engine, fake = _engine(device_type, free_cache_engine)
    engine.sleep(keep_weights=False)
    engine.wake_up()
    assert fake.calls == []
    engine._require_weights("generate")


def test_close_wakes_a_sleeping_engine_before_tearing_it_down(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, fake = _engine()
    engine.sleep(keep_weights=False)
    _load(engine)  # the last step: the sync woke the weights, the KV cache still sleeps
    fake.calls.clear()
    parallel_state = types.SimpleNamespace(
        destroy_model_parallel=lambda: fake.calls.append(("destroy_model_parallel", None)), _WORLD=None
    )
    vllm_distributed = types.ModuleType("vllm.distributed")
    vllm_distributed.parallel_state = parallel_state  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", vllm_distributed)
    engine.close()
    assert fake.calls == [
        ("wake_up", ["kv_cache"]),
        ("executor.shutdown", None),
        ("scheduler.shutdown", None),
        ("destroy_model_parallel", None),
    ]
    assert not hasattr(engine, "llm")


def _spec() -> Any:
    from spmdrl.rollout.engine import SamplingSpec

    return SamplingSpec(max_tokens=4)


# ---- process-wide settings -----------------------------------------------------------------------------

_SETTINGS_SCRIPT = """
import gc
import torch
from spmdrl.rollout.vllm_process import SettingsSwap

def matmul():
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "mixed"

def per_backend():
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision

{setup}
frozen = gc.get_freeze_count()
trainer = (matmul(), per_backend(), torch.backends.cuda.cudnn_sdp_enabled())
swap = SettingsSwap()
with swap.building():
    # What building vLLM does (Worker.__init__, vllm/platforms/cuda.py, EngineCore.__init__).
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.enable_cudnn_sdp(False)
    gc.freeze()
assert (matmul(), per_backend(), torch.backends.cuda.cudnn_sdp_enabled()) == trainer, trainer
assert gc.get_freeze_count() == frozen
with swap.engine_call():
    assert matmul() == "highest" and not torch.backends.cuda.cudnn_sdp_enabled()
assert (matmul(), per_backend(), torch.backends.cuda.cudnn_sdp_enabled()) == trainer, trainer
"""


def _exec(rank: int, world: int, script: str) -> str:
    exec(script, {"__name__": "settings_script"})
    return "ok"


@pytest.mark.parametrize(
    "setup",
    [
        "",  # torch's defaults
        "torch.set_float32_matmul_precision('high')",  # the legacy API
        "torch.backends.fp32_precision = 'tf32'",  # the per-backend API (the legacy getter then raises)
    ],
)
def test_trainer_keeps_its_process_settings(setup: str) -> None:
    """In a process of its own (the settings are process-wide), forked from the tests' fork server, which
    has imported torch and vLLM and changed none of these settings (spmdrl.testing.prefork_imports)."""
    script = textwrap.dedent(_SETTINGS_SCRIPT).replace("{setup}", setup)
    assert run_distributed(_exec, 1, script, timeout_s=120) == ["ok"]


def test_engine_settings_this_machine_cannot_run_fail_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU without native bf16 and a missing zentorch are faked (CPU flags, the import), since neither
    can be had here on demand."""
    from spmdrl.config import ConfigError, RolloutConfig
    from spmdrl.rollout.engine import check_engine_config

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(ConfigError, match="AVX512-BF16 or AMX"):
        check_engine_config(RolloutConfig(cpu_gemm="sgl"), "cpu")
    check_engine_config(RolloutConfig(cpu_gemm="torch"), "cpu")  # runs anywhere
    check_engine_config(RolloutConfig(cpu_gemm="sgl"), "cuda")  # a CPU-only setting
    monkeypatch.setitem(sys.modules, "zentorch", None)  # import zentorch -> ImportError
    with pytest.raises(ConfigError, match="pip install 'zentorch=="):
        check_engine_config(RolloutConfig(cpu_gemm="zentorch"), "cpu")


def test_auto_engine_dtype_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without native bf16 cannot be had here on demand, so its capability flags are faked."""
    from spmdrl.errors import ConfigError
    from spmdrl.rollout.vllm_plan import resolve_engine_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_engine_dtype("auto", "cpu") == torch.float32
    assert resolve_engine_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_engine_dtype("bfloat16", "cpu") == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert resolve_engine_dtype("auto", "cpu") == torch.bfloat16
    with pytest.raises(ConfigError, match="rollout.dtype"):
        resolve_engine_dtype("fp8", "cpu")
