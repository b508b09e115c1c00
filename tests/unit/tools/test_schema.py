"""Function schemas from signatures and docstrings, and argument validation (spmdrl/tools/schema.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.errors import ConfigError
from spmdrl.tools import (
    load_function_tool,
)
from spmdrl.tools.schema import function_schema, validate_arguments


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
