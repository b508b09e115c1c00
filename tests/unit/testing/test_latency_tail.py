"""The latency tail's launcher (spmdrl/testing/latency_tail.py): which prompts are slow, the checks against
the config, the wrapper around a Rollout (a stand-in engine: the waits and their report), the launcher's
arguments, and the old config key's error (a real engine's calls with the tail:
tests/integration/test_latency_tail.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from spmdrl.config import Config, TrainerConfig
from spmdrl.data.prompts import PromptExample
from spmdrl.errors import ConfigError
from spmdrl.rollout import rollout as rollout_module
from spmdrl.rollout.engine import Generation, SamplingSpec, request_seed
from spmdrl.rollout.interruptible import VersionedGenerations
from spmdrl.rollout.rollout import Rollout, build_rollout
from spmdrl.testing.latency_tail import LatencyTail, LatencyTailRollout, install, parse_args, slow_prompts


def test_slow_prompts_is_a_seeded_choice_of_count_distinct_prompts() -> None:
    for seed in range(50):
        slow = slow_prompts(16, 3, seed)
        assert slow == sorted(set(slow)) and len(slow) == 3 and all(0 <= i < 16 for i in slow)
        assert slow_prompts(16, 3, seed) == slow  # the seed alone decides
    choices = {tuple(slow_prompts(16, 3, seed)) for seed in range(50)}
    assert len(choices) > 40  # not one fixed set: the slow prompts move from call to call
    assert set().union(*map(set, choices)) == set(range(16))


def test_slow_prompts_edges() -> None:
    assert slow_prompts(4, 0, 7) == []
    assert slow_prompts(0, 2, 7) == []  # a rank with nothing to generate waits for nothing
    assert slow_prompts(3, 5, 7) == [0, 1, 2]  # fewer prompts than count: all of them
    assert slow_prompts(3, 3, 7) == [0, 1, 2]


def test_checks_against_the_config() -> None:
    cfg = Config(trainer=TrainerConfig(global_batch_size=8))
    LatencyTail(0, 0.0).check(cfg)
    LatencyTail(8, 30.0).check(cfg)  # every prompt of the step slow: allowed
    LatencyTail(2, 0.0).check(cfg)  # 0 seconds: off, not an error
    assert not LatencyTail(2, 0.0).enabled and LatencyTail(1, 0.5).enabled
    with pytest.raises(ConfigError, match=r"--prompts and --seconds must be >= 0 .*got -1, 1\.0"):
        LatencyTail(-1, 1.0).check(cfg)
    with pytest.raises(ConfigError, match=r"must be >= 0 .*got 1, -0\.5"):
        LatencyTail(1, -0.5).check(cfg)
    with pytest.raises(ConfigError, match=r"--prompts 9 is more than the step's batch .*global_batch_size=8"):
        LatencyTail(9, 1.0).check(cfg)
    with pytest.raises(ConfigError, match=r"--seconds 600.0 must stay below trainer\.collective_timeout_min"):
        LatencyTail(1, 600.0).check(cfg)


def test_the_launcher_reads_its_own_arguments_and_passes_the_rest_on_in_order() -> None:
    argv = ["--prompts", "2", "recipe=grpo_tiny", "--seconds=1.5", "trainer.total_steps=3", "--cfg", "job"]
    tail, rest = parse_args(argv)
    assert tail == LatencyTail(2, 1.5)
    assert rest == ["recipe=grpo_tiny", "trainer.total_steps=3", "--cfg", "job"]
    with pytest.raises(SystemExit):
        parse_args(["recipe=grpo_tiny"])  # both are required: the launcher is for the tail


def test_the_removed_config_key_names_the_launcher() -> None:
    from spmdrl.config_loader import load_config

    with pytest.raises(
        ConfigError, match=r"'rollout\.latency_tail' is gone: .*-m spmdrl\.testing\.latency_tail"
    ):
        load_config(["recipe=grpo_tiny", "rollout.latency_tail.prompts=2"])


def test_the_removed_config_key_in_a_yaml_names_the_launcher(tmp_path) -> None:
    from spmdrl.config_loader import load_config

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        "defaults: [grpo_tiny, _self_]\nrollout:\n  latency_tail:\n    prompts: 2\n    seconds: 1\n"
    )
    with pytest.raises(ConfigError, match=r"'rollout\.latency_tail' is gone: .*--prompts P --seconds S"):
        load_config([f"recipe={recipe}"])


# ------------------------------------------------------------------------------- the wrapper, no engine
class _Inner(Rollout):
    """A Rollout over a stand-in engine (engine index 3): empty generations, and an interruptible call
    that polls ``steps`` times as a real one polls before each engine step."""

    def __init__(self, steps: int = 4) -> None:
        super().__init__(SimpleNamespace(groups=SimpleNamespace(dp_index=3)))  # type: ignore[arg-type]
        self.steps = steps
        self.polled_at: list[float] = []

    def generate(self, prompts, spec, *, training=True) -> list[Generation]:  # noqa: ANN001
        return []

    def generate_interruptible(  # noqa: ANN001
        self, prompts, spec, *, version: int, poll: Callable[[], bool], switch, mode
    ) -> VersionedGenerations:
        for _ in range(self.steps):
            poll()
            self.polled_at.append(time.perf_counter())
        return VersionedGenerations([], [], [])


def _prompts(n: int) -> list[PromptExample]:
    return [PromptExample(i, [1, 2], [], "", "t", {}) for i in range(n)]


def test_a_training_call_waits_and_a_validation_call_does_not() -> None:
    tail = LatencyTailRollout(_Inner(), LatencyTail(prompts=1, seconds=0.2))
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=4, seed=42)
    t0 = time.perf_counter()
    tail.generate(_prompts(4), spec)
    assert time.perf_counter() - t0 >= 0.2
    assert tail.last_slow_prompts == slow_prompts(4, 1, request_seed(42, 3))  # the engine's index seeds it
    t0 = time.perf_counter()
    tail.generate(_prompts(4), spec, training=False)
    assert time.perf_counter() - t0 < 0.2
    metrics = tail.take_metrics(torch.device("cpu"))
    assert metrics.keys() == {"rollout/wait_s"} and 0.2 <= metrics["rollout/wait_s"] < 1.0
    assert tail.take_wait_seconds() == 0.0 and tail.take_metrics(torch.device("cpu")) == {}  # taken
    tail.generate([], spec)  # a rank with nothing to generate waits for nothing
    assert tail.take_wait_seconds() == 0.0


def test_an_interruptible_call_stalls_after_its_first_engine_step() -> None:
    inner = _Inner(steps=4)
    tail = LatencyTailRollout(inner, LatencyTail(prompts=1, seconds=0.3))
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=4, seed=7)
    tail.generate_interruptible(
        _prompts(2), spec, version=0, poll=lambda: False, switch=lambda: 1, mode="continue"
    )
    gaps = [b - a for a, b in zip(inner.polled_at, inner.polled_at[1:], strict=False)]
    assert gaps[0] >= 0.3 and max(gaps[1:]) < 0.3, gaps  # the second poll waited, the others did not
    assert tail.take_wait_seconds() >= 0.3


def test_build_rollout_applies_what_the_launcher_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_module, "_WRAPPERS", [])
    engine = SimpleNamespace(groups=SimpleNamespace(dp_index=0))
    install(LatencyTail(0, 1.0))  # off: nothing installed
    assert type(build_rollout(engine)) is Rollout  # type: ignore[arg-type]
    install(LatencyTail(1, 1.0))
    wrapped = build_rollout(engine)  # type: ignore[arg-type]
    assert isinstance(wrapped, LatencyTailRollout) and type(wrapped.inner) is Rollout
    assert wrapped.engine is engine and wrapped.take_wait_seconds() == 0.0


def test_the_launcher_refuses_a_tail_the_config_cannot_hold() -> None:
    """The launcher's whole path short of a run, as a forked rank: its arguments, spmdrl.train's config,
    the tail checked against it, the config error's exit (grpo_tiny's batch is 32 prompts)."""
    import os

    from spmdrl.testing import prefork
    from spmdrl.testing.spawn import free_port

    argv = ["-m", "spmdrl.testing.latency_tail", "--prompts", "33", "--seconds", "1", "recipe=grpo_tiny"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code, output, timed_out = prefork.run_job(
        argv, nproc=1, cwd=None, env=env, port=free_port(), timeout_s=120
    )
    assert (code, timed_out) == (1, False)
    assert "latency tail: --prompts 33 is more than the step's batch" in output, output
