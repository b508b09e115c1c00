"""Function schemas from signatures and docstrings, and argument validation (spmdrl/tools/schema.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.config import ConfigError
from spmdrl.tools import (
    load_function_tool,
)
from spmdrl.tools.schema import function_schema, validate_arguments

# -------------------------------------------------------------------------------------- function tools

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


def test_function_schema_derived_from_signature_and_docstring(functions_file: Path) -> None:
    tool = load_function_tool(f"{functions_file}:weather")
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast the weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name."},
                    "days": {"type": "integer", "description": "How many days, counted from today."},
                    "unit": {"type": "string", "enum": ["C", "F"], "description": "Temperature unit."},
                    "hourly": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    }
    params = load_function_tool(f"{functions_file}:scores").schema["function"]["parameters"]
    assert params["properties"] == {
        "values": {"type": "array", "items": {"type": "number"}, "description": "the values"},
        "weights": {"type": "object", "additionalProperties": {"type": "number"}},
        "note": {"type": "string"},
    }
    assert params["required"] == ["values", "weights"]  # note: T | None is optional
    with pytest.raises(ConfigError, match="parameter 'x' has no type hint"):
        load_function_tool(f"{functions_file}:untyped")

    def positional(a: int, /) -> int:
        return a

    with pytest.raises(ConfigError, match="positional-only"):
        function_schema(positional)


def test_validate_arguments_json_schema_subset() -> None:
    schema = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer"},
                    "x": {"type": ["number", "null"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "opt": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]},
                },
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    }
    assert validate_arguments(schema, {"n": 3, "x": None, "tags": ["a"], "opt": {"k": True}}) == []
    assert validate_arguments(schema, {"n": 3.0}) == []  # JSON Schema: 3.0 is an integer
    assert validate_arguments(schema, {"n": True, "x": "1", "tags": ["a", 2], "opt": {}, "zzz": 1}) == [
        "unknown argument 'zzz' (expected: n, x, tags, opt)",
        "argument 'n' must be integer, got bool True",
        "argument 'x' must be number or null, got str '1'",
        "argument 'tags'[1] must be string, got int 2",
        "argument 'opt' is missing key 'k'",
    ]
    assert validate_arguments(schema, {}) == ["missing required argument 'n'"]
