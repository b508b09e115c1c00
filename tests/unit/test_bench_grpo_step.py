"""benchmarks/grpo_step.py's reading of TRL's profiling contexts, without TRL: which forward is the
pre-update pass, and how the step splits into phases (the run path needs TRL, a benchmark dependency)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as `python benchmarks/grpo_step.py` runs it
    import grpo_step

    return grpo_step


def _vllm_step(bench: ModuleType, seconds: float) -> object:
    """One colocated-vLLM step's contexts in the order TRL ends them."""
    profile = bench._Profile()
    for name, t in [
        (bench.TRL_SYNC, 0.02),
        (bench.TRL_VLLM_GENERATE, 1.0),
        (bench.TRL_REWARD, 0.01),
        (bench.TRL_LOGPS, 0.9),  # inside _prepare_inputs: the old logprobs
        (bench.TRL_PREPARE, 2.0),
        (bench.TRL_LOGPS, 1.1),  # the loss's forward, in the update
    ]:
        profile.record(name, t)
    return bench.TrlStep(seconds, profile.current, 4.5)


def test_the_forward_before_the_batch_is_ready_is_the_old_logprob_pass(bench: ModuleType) -> None:
    phases = _vllm_step(bench, 4.5).phases
    assert phases[bench.TRL_OLD] == 0.9 and phases[bench.TRL_LOGPS] == 1.1


def test_vllm_mode_phases_add_up_to_the_step(bench: ModuleType) -> None:
    r = bench._trl_medians([_vllm_step(bench, 4.5), _vllm_step(bench, 4.7)], [100.0, 110.0], 64)
    p = r.phases
    assert r.step_s == pytest.approx(4.6)
    assert (p["rollout"], p["old_ref"], p["weight_sync"]) == (1.0, 0.9, 0.02)
    assert p["update"] == pytest.approx(2.6)  # the step after _prepare_inputs
    # What _prepare_inputs holds besides them (tokenizing, advantages): 2.0 - 1.0 - 0.01 - 0.9 - 0.02.
    assert p["other"] == pytest.approx(0.07)
    assert r.extra["rollout_tokens_per_s"] == pytest.approx(105.0 * 64 / 1.0)


def test_generate_mode_has_no_sync_or_old_pass_rows(bench: ModuleType) -> None:
    profile = bench._Profile()
    for name, t in [(bench.TRL_GENERATE, 2.4), (bench.TRL_REWARD, 0.0), (bench.TRL_PREPARE, 2.5)]:
        profile.record(name, t)
    r = bench._trl_medians([bench.TrlStep(5.2, profile.current, 3.2)], [113.0], 64)
    assert set(r.phases) == {"rollout", "reward", "update", "other"}
    assert r.phases["update"] == pytest.approx(2.7)


def test_spmdrl_rows_report_the_trainer_engine_gap(bench: ModuleType) -> None:
    """The job's own mismatch metric becomes a row (the GPU run's parity figure); TRL's columns have none."""
    rows = [
        {"step": s, "timing/step_s": 1.0, "timing/rollout_s": 0.5, "rollout/response_len_mean": 100.0,
         "perf/rollout_tokens_per_s": 1e4, bench.MISMATCH: gap}
        for s, gap in ((1, 3e-7), (2, 5e-7), (3, 4e-7))
    ]  # fmt: skip
    ours = bench._spmdrl_medians(rows)
    assert bench.values(ours)["logprob_abs_diff_mean"] == pytest.approx(4e-7)
    assert "logprob_abs_diff_mean" in bench.row_keys([ours])
    trl = bench._trl_medians([_vllm_step(bench, 4.5)], [100.0], 64)
    assert "logprob_abs_diff_mean" not in bench.values(trl)
    (col,) = [c for c in bench.table_columns({bench.DEFAULT: ours}, trl) if c.header == bench.DEFAULT]
    assert col.cell("logprob_abs_diff_mean") == "4.00e-07"
