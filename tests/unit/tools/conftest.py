"""Fixtures of the tool tests."""

from __future__ import annotations

from pathlib import Path

import pytest

# A module of function tools (schemas from signatures and docstrings; create_kwargs; failures).
FUNCTIONS = '''
from typing import Literal


def weather(city: str, days: int = 1, unit: Literal["C", "F"] = "C", hourly: bool | None = None,
            create_kwargs: dict | None = None) -> dict:
    """Forecast the weather.

    More words that are not the summary.

    Args:
        city: The city's name.
        days (int): How many days,
            counted from today.
        unit: Temperature unit.
    """
    return {"city": city, "days": days, "unit": unit, "truth": (create_kwargs or {}).get("truth")}


def scores(values: list[float], weights: dict[str, float], note: str | None) -> str:
    """:param values: the values"""
    return "ok"


def untyped(x):
    return x


def fails(x: int) -> str:
    if x == 0:
        raise ValueError("x must not be 0")
    from spmdrl.tools import ToolError
    raise ToolError(f"{x} is not allowed")


def returns_bytes() -> bytes:
    return b"x"


def sleeps(seconds: float) -> str:
    import time
    time.sleep(seconds)
    return "slept"
'''


@pytest.fixture
def functions_file(tmp_path: Path) -> Path:
    path = tmp_path / "functions.py"
    path.write_text(FUNCTIONS)
    return path
