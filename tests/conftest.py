"""Suite-wide options and tiers.

The tiers are folders: tests/unit/ (named after the modules they test, mirroring spmdrl/) and
tests/integration/ (processes, engines, torchrun jobs), which is marked ``slow`` here, so that
``-m "not slow"`` is exactly the unit tier. A unit test marked ``slow`` is refused: it belongs in
tests/integration/.

The default run is the unit tier plus the integration tests marked ``guarantee(KEY)``, one per guarantee
of tests/tiers.py (docs/testing.md has the map). ``--all`` (or ``SPMDRL_ALL_TESTS=1``; ``--extended`` is
the old name) runs every test. A test file named on the command line runs whole in either case, so
``pytest tests/integration/test_lora.py`` runs what it says.

``--cpu-kind`` runs the tests as another x86 CPU kind would (spmdrl.testing.cpu_kind).

``pytest --cpu-kind=avx2`` (or ``SPMDRL_CPU_KIND=avx2``) makes this process and every process it starts
(torchrun jobs, forked and spawned ranks, subprocesses) detect that kind's CPU flags and run its kernels:
vLLM's AVX2 library, a float32 engine, oneDNN and ATen capped at AVX2. The children get it from the
environment set here, whose ``PYTHONPATH`` runs the emulation's sitecustomize when each starts. CI runs the tests marked ``cpu_kinds`` (those whose
outcome depends on what the engine picks for the CPU) once as each kind this machine can emulate.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiers import GUARANTEES, in_default_tier

INTEGRATION = Path(__file__).parent / "integration"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-kind",
        default=os.environ.get("SPMDRL_CPU_KIND", ""),
        help="run as this CPU kind: avx2, avx512 or avx512_bf16 (no more capable than this host; spmdrl.testing.cpu_kind)",
    )
    parser.addoption(
        "--all",
        "--extended",
        dest="all_tests",
        action="store_true",
        default=os.environ.get("SPMDRL_ALL_TESTS", os.environ.get("SPMDRL_EXTENDED_TESTS", "")) == "1",
        help="run every test, not only the default tier (the unit tier and the guarantee tests; docs/testing.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    kind = config.getoption("--cpu-kind")
    if not kind:
        return
    from spmdrl.testing import cpu_kind

    try:
        # In os.environ before any test starts a process, so each child starts as this kind too (its
        # PYTHONPATH runs the emulation's sitecustomize first).
        os.environ.update(cpu_kind.environment(kind))
        cpu_kind.emulate(kind)
    except cpu_kind.CpuKindError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config: pytest.Config) -> list[str]:
    from spmdrl.testing import cpu_kind

    active = cpu_kind.active()
    tier = (
        "tier: all tests (--all)"
        if config.getoption("all_tests")
        else "tier: default (the unit tier and the integration tests marked guarantee; --all runs every test)"
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
    unknown = [
        f"{item.nodeid}: {key!r}" for item in items for key in _guarantees(item) if key not in GUARANTEES
    ]
    if unknown:
        raise pytest.UsageError(f"guarantee marks naming no guarantee of tests/tiers.py: {unknown}")
    if config.getoption("all_tests"):
        return
    named = _named_files(config)
    left_out = [
        item for item in items if not in_default_tier(item.path, INTEGRATION, _guarantees(item), named)
    ]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(map(id, left_out))
        items[:] = [item for item in items if id(item) not in dropped]


def _guarantees(item: pytest.Item) -> list[str]:
    """The guarantee keys an item's marks name (``@pytest.mark.guarantee("resume:kill")``)."""
    return [key for mark in item.iter_markers("guarantee") for key in mark.args]


def _named_files(config: pytest.Config) -> set[Path]:
    """The test files named on the command line (a path or a node id), which run whole in any tier."""
    files = set()
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if path.is_file():
            files.add(path)
    return files


@pytest.fixture
def rewards(tmp_path: Path) -> Iterator[Path]:
    """tests/sandbox_rewards.py's reward functions as a file; each test starts and ends with no worker
    processes."""
    from spmdrl.rewards import sandbox_pool
    from tests.sandbox_rewards import REWARDS

    path = tmp_path / "sandbox_rewards.py"
    path.write_text(REWARDS)
    sandbox_pool.shared_pool().shutdown()
    yield path
    sandbox_pool.shared_pool().shutdown()
