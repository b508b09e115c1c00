"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from spmdrl import config as config_module


@pytest.fixture
def restore_sections() -> Iterator[None]:
    """Each test's entry files register sections; forget them afterwards (the registry is process-wide)."""
    saved = dict(config_module.CONFIG_SECTIONS)
    yield
    config_module.CONFIG_SECTIONS.clear()
    config_module.CONFIG_SECTIONS.update(saved)
