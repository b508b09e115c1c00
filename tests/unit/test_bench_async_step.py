"""benchmarks/async_step.py without running a job: its arguments, the jobs' overrides (composed by the real
config loader), and the figures and table read from metrics.jsonl files written here. The run path, a
real job, is tests/integration/test_bench_async_step.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as `python benchmarks/async_step.py` runs it
    import async_step

    return async_step


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(step_s: list[float], ages: list[float] | None = None, tail_s: float | None = None) -> list[dict]:
    """A run's rows: validation at step 0, a row per step, validation again at the last."""
    rows: list[dict] = [{"step": 0, "val/accuracy": 0.4}]
    for i, s in enumerate(step_s, start=1):
        row = {"step": i, "timing/step_s": s, "timing/rollout_s": s / 2, "rollout/reward_mean": 0.5}
        if ages is not None:
            row |= {"async/policy_age_mean": ages[i - 1], "async/policy_age_max": math.ceil(ages[i - 1])}
        if tail_s is not None:
            row["rollout/wait_s"] = tail_s
        rows.append(row)
    rows.append({"step": len(step_s), "val/accuracy": 0.7})
    return rows


def test_read_result_windows(bench: ModuleType, tmp_path: Path) -> None:
    job = bench.Job(1, True)
    path = _write(tmp_path / "m.jsonl", _rows([9.0, 2.0, 2.0, 4.0], ages=[0.0, 1.0, 1.0, 0.5], tail_s=2.0))
    r = bench.read_result(job, path, warmup=1)
    # The run: every step. Steady: after the warm-up step, before the last k=1 step (the drain).
    assert r.steps == 4 and r.steps_per_hour == pytest.approx(4 * 3600 / 17.0)
    assert r.steady_steps == 2 and r.steady_steps_per_hour == pytest.approx(2 * 3600 / 4.0)
    assert r.step_s == 2.0 and r.rollout_s == 1.0  # the steady steps'
    assert r.policy_age_mean == 1.0 and r.policy_age_max == 1
    assert r.tail_s == 2.0 and r.val_accuracy == 0.7  # the last validation
    sync = bench.read_result(bench.Job(0, False), _write(tmp_path / "s.jsonl", _rows([5.0, 4.0])), warmup=1)
    assert sync.steady_steps_per_hour == pytest.approx(900.0)  # k=0: no drain, step 2 counts
    assert sync.policy_age_mean is None and sync.policy_age_max is None and sync.tail_s is None
    # No steady step (k=2 of 2 steps): the run's figure alone, the means over every step.
    short = bench.read_result(bench.Job(2, False), _write(tmp_path / "k2.jsonl", _rows([5.0, 3.0])), warmup=1)
    assert short.steady_steps == 0 and short.steady_steps_per_hour is None and short.step_s == 4.0
    with pytest.raises(ValueError, match="no step row with timing/step_s"):
        bench.read_result(job, _write(tmp_path / "none.jsonl", [{"step": 0, "val/accuracy": 0.5}]), warmup=1)


def test_table_ratios_are_against_k0_of_the_same_tail(bench: ModuleType, tmp_path: Path) -> None:
    def result(k: int, tail: bool, step_s: float, ages: list[float] | None) -> object:
        path = _write(tmp_path / f"{k}{tail}.jsonl", _rows([step_s] * 4, ages))
        return bench.read_result(bench.Job(k, tail), path, warmup=1)

    results = [
        result(0, False, 2.0, [0, 0, 0, 0]),
        result(1, False, 1.6, [0, 1, 1, 1]),
        result(0, True, 4.0, None),  # a recipe without async/* keys
        result(2, True, 2.0, [0, 2, 2, 2]),
    ]
    assert [bench.speedup(r, results) for r in results] == pytest.approx([1.0, 1.25, 1.0, 2.0])
    steady = [bench.speedup(r, results, "steady_steps_per_hour") for r in results]
    assert steady == pytest.approx([1.0, 1.25, 1.0, 2.0])
    lines = bench.table(results, "2x2s").splitlines()
    assert lines[0].split() == ["k", "tail", "run/h", "x", "k=0", "steady/h", "x", "k=0", *bench.COLUMNS[6:]]
    assert lines[2].split()[:6] == ["1", "off", "2250", "1.25", "2250", "1.25"]
    k0_tail = lines[3].split()
    assert k0_tail[:6] == ["0", "2x2s", "900", "1.00", "900", "1.00"] and k0_tail[9:11] == ["-", "-"]
    assert (
        lines[4].split()[:6] == ["2", "2x2s", "1800", "2.00", "1800", "2.00"] and lines[4].split()[10] == "2"
    )
    # Without a k=0 job of the same tail setting, no ratio.
    assert bench.speedup(results[1], results[1:2]) is None
    assert bench.table(results[1:2], "-").splitlines()[1].split()[3] == "-"
    figs = {f.name: f for f in bench.figures(results)}
    assert figs["async_step/k2_tail/steps_per_hour"].ratio == pytest.approx(2.0)
    assert figs["async_step/k2_tail/steady_steps_per_hour"].ratio == pytest.approx(2.0)
    assert figs["async_step/k1/steps_per_hour"].baseline == pytest.approx(1800.0)
    assert figs["async_step/k2_tail/policy_age_max"].value == 2
    assert "async_step/k0_tail/policy_age_mean" not in figs


def test_jobs_and_their_overrides_compose(bench: ModuleType) -> None:
    from spmdrl.config_loader import load_config

    a = bench._args(["--staleness", "2,0,1", "--set", "trainer.val_every=0", "--tail-prompts", "3"])
    assert a.staleness == [0, 1, 2]
    names = [j.name for j in bench.jobs(a)]
    assert names == ["k0", "k1", "k2", "k0_tail", "k1_tail", "k2_tail"]
    cfg = load_config(bench.overrides(a, bench.Job(2, True), Path("out")))
    assert cfg.name == "grpo_async_tiny" and cfg.trainer.max_staleness == 2
    assert cfg.trainer.val_every == 0 and cfg.trainer.log_every == 1 and cfg.trainer.output_dir == "out"
    off = load_config(bench.overrides(a, bench.Job(0, False), Path("out")))
    assert off.trainer.max_staleness == 0
    # The tail's jobs run through its launcher (it wraps the job's Rollout); the others: the plain recipe.
    tail = ["-m", "spmdrl.testing.latency_tail", "--prompts", "3", "--seconds", "2.0"]
    assert bench.launcher(a, bench.Job(2, True)) == tail
    assert bench.launcher(a, bench.Job(0, False)) == ["-m", "spmdrl.train"]
    assert [j.name for j in bench.jobs(bench._args(["--tail", "off", "--staleness", "1"]))] == ["k1"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--staleness", "0,x"], "--staleness: expected integers"),
        (["--staleness", "-1"], "each >= 0"),
        (["--steps", "1"], "must be more than --warmup"),
        (["--steps", "3"], "+ the largest staleness"),  # k=2 of 3 steps: no steady step
        (["--tail-seconds", "0"], "needs --tail-prompts and --tail-seconds > 0"),
        (["--set", "trainer.output_dir=x"], "trainer.output_dir is set by the script"),
        (["--set", "oops"], "expected KEY=VALUE"),
    ],
)
def test_bad_arguments(
    bench: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        bench._args(argv)
    assert message in capsys.readouterr().err


def test_a_bad_override_fails_before_any_job(bench: ModuleType) -> None:
    a = bench._args(["--set", "trainer.totl_steps=3", "--tail", "off"])
    with pytest.raises(SystemExit, match=r"the k0 job's config: unknown config key 'trainer\.totl_steps'"):
        bench.check_configs(a)
    # The tail is checked against each tail job's config: more slow prompts than grpo_async_tiny's batch.
    a = bench._args(["--staleness", "0", "--tail", "on", "--tail-prompts", "65"])
    with pytest.raises(SystemExit, match=r"the k0_tail job's config: latency tail: --prompts 65 is more"):
        bench.check_configs(a)
