"""The suite's tiers (tests/tiers.py, tests/conftest.py): every guarantee of the default run is held by a
marked test, docs/testing.md's map names each guarantee beside the tests that hold it, and the default
tier is the unit tier plus those tests."""

from __future__ import annotations

import re
from pathlib import Path

from tests.tiers import GUARANTEES, in_default_tier

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r'guarantee\("([^"]+)"\)')


def _holders() -> dict[str, set[str]]:
    """guarantee key -> names of the test functions (or modules) marked with it, read from the sources."""
    holders: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            for key in MARK.findall(line):
                if line.startswith("pytestmark"):
                    name = path.stem
                else:  # the first test function at or below the mark (decorators and params in between)
                    name = next(m.group(1) for m in map(re.compile(r"def (test_\w+)").search, lines[i:]) if m)
                holders.setdefault(key, set()).add(name)
    return holders


def test_every_guarantee_is_held_and_every_mark_names_one() -> None:
    holders = _holders()
    assert set(holders) == set(GUARANTEES), (
        f"held by no test: {sorted(set(GUARANTEES) - set(holders))}; "
        f"marked but not in tests/tiers.py: {sorted(set(holders) - set(GUARANTEES))}"
    )


def test_the_map_in_the_docs_names_each_guarantee_and_its_tests() -> None:
    rows = [
        line for line in (ROOT / "docs" / "testing.md").read_text().splitlines() if line.startswith("| `")
    ]
    by_key = {row.split("`")[1]: row for row in rows}
    missing = [key for key in GUARANTEES if key not in by_key]
    assert not missing, f"docs/testing.md's map lacks {missing}"
    for key, names in _holders().items():
        for name in names:
            assert name in by_key[key], f"docs/testing.md's row for {key} does not name {name}"


def test_the_default_tier_is_the_unit_tier_and_the_guarantees() -> None:
    integration = ROOT / "tests" / "integration"
    unit = ROOT / "tests" / "unit" / "test_config.py"
    lora = integration / "test_lora.py"
    assert in_default_tier(unit, integration, [], named=[])
    assert in_default_tier(lora, integration, ["recipe:grpo_lora_tiny"], named=[])
    assert not in_default_tier(lora, integration, [], named=[])  # --all only
    assert in_default_tier(lora, integration, [], named=[lora])  # named on the command line: runs whole
