"""Suite-wide options and tiers.

The tiers are folders: tests/unit/ (named after the modules they test, mirroring spmdrl/) and
tests/integration/ (processes, engines, torchrun jobs), which is marked ``slow`` here, so that
``-m "not slow"`` is exactly the unit tier. A unit test marked ``slow`` is refused: it belongs in
tests/integration/.

``--cpu-kind`` runs the tests as another x86 CPU kind would (spmdrl.cpu_kind).

Tests marked ``extended`` run only with ``--extended`` (or ``SPMDRL_EXTENDED_TESTS=1``): long end-to-end
variants whose parts other tests cover (docs/testing.md lists them), kept out of the default run so that
CI's run fits its 90 minutes on a slow 2-core machine.

``pytest --cpu-kind=avx2`` (or ``SPMDRL_CPU_KIND=avx2``) makes this process and every process it starts
(torchrun jobs, spawned ranks) detect that kind's CPU flags and run its kernels: vLLM's AVX2 library,
a float32 engine, oneDNN and ATen capped at AVX2. CI runs the tests marked ``cpu_kinds`` (those whose
outcome depends on what the engine picks for the CPU) once as each kind this machine can emulate.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).parent / "integration"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-kind",
        default=os.environ.get("SPMDRL_CPU_KIND", ""),
        help="run as this CPU kind: avx2, avx512 or avx512_bf16 (no more capable than this host; see spmdrl.cpu_kind)",
    )
    parser.addoption(
        "--extended",
        action="store_true",
        default=os.environ.get("SPMDRL_EXTENDED_TESTS", "") == "1",
        help="also run the tests marked extended (long end-to-end variants; docs/testing.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    kind = config.getoption("--cpu-kind")
    if not kind:
        return
    from spmdrl import cpu_kind

    try:
        # In os.environ before any test starts a process, so each child starts as this kind too.
        os.environ.update(cpu_kind.environment(kind))
        cpu_kind.emulate(kind)
    except cpu_kind.CpuKindError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config: pytest.Config) -> str:
    from spmdrl import cpu_kind

    active = cpu_kind.active()
    tier = (
        "extended tests included"
        if config.getoption("--extended")
        else "extended tests left out (--extended)"
    )
    if active is None:
        return [f"cpu kind: {cpu_kind.host_kind()} (this host's own)", tier]
    return [f"cpu kind: {active.name}, emulated on a host of kind {cpu_kind.host_kind()}", tier]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misplaced = []
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("slow") is not None:
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(f"slow tests outside tests/integration/ (move them there): {misplaced}")
    if not config.getoption("--extended"):
        extended = [item for item in items if item.get_closest_marker("extended") is not None]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if item.get_closest_marker("extended") is None]


@pytest.fixture
def rewards(tmp_path: Path) -> Iterator[Path]:
    """tests/sandbox_rewards.py's reward functions as a file; each test starts and ends with no worker
    processes."""
    from spmdrl.rewards import sandbox
    from tests.sandbox_rewards import REWARDS

    path = tmp_path / "sandbox_rewards.py"
    path.write_text(REWARDS)
    sandbox._pool().shutdown()
    yield path
    sandbox._pool().shutdown()
