"""Tool schemas (spmdrl/tools/base.py) read like verl's pydantic schema."""

from __future__ import annotations

import pytest

from spmdrl.tools.base import ToolSchema

SCHEMA_ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Upper-case a text",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


def test_tool_schema_reads_like_verls_pydantic_schema() -> None:
    schema = ToolSchema(SCHEMA_ECHO)
    assert schema.function.name == "echo" and schema.function.parameters.required == ["text"]
    assert schema.model_dump() == SCHEMA_ECHO and type(schema.model_dump()) is dict
    with pytest.raises(AttributeError):
        _ = schema.function.nothing
