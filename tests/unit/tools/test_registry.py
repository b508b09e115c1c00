"""Tool loading (spmdrl/tools/registry.py): verl YAML, file paths and built-in short names, function tools,
and config errors for bad specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmdrl.errors import ConfigError
from spmdrl.tools import (
    ToolCall,
    ToolExecutor,
    load_tools,
    tool_schemas,
)
from spmdrl.tools.builtin import CalculatorTool, PythonTool

# ---------------------------------------------------------------------------------------- tool loading

TOOL_MODULE = '''
import asyncio
from spmdrl.tools import BaseTool, ToolResult


class Echo(BaseTool):
    """A spmdrl tool: upper-cases its text, with the ground truth from create_kwargs."""

    def execute(self, instance_id, arguments):
        truth = self.instances[instance_id].get("ground_truth", "")
        return ToolResult(arguments["text"].upper(), reward=float(arguments["text"] == truth), metrics={"n": 1})


class Response:  # like verl's ToolResponse
    def __init__(self, text):
        self.text = text


class VerlStyle:
    """Written against verl: async methods, tuple results, schema as an object with attributes."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        self.live = {}

    async def create(self, instance_id=None, **kwargs):
        await asyncio.sleep(0)
        self.live[instance_id] = kwargs.get("create_kwargs", {}).get("ground_truth")
        return instance_id, Response("")

    async def execute(self, instance_id, parameters, **kwargs):
        right = parameters["answer"] == self.live[instance_id]
        return Response(f"answer {parameters['answer']} is {'right' if right else 'wrong'}"), float(right), {}

    async def release(self, instance_id, **kwargs):
        del self.live[instance_id]


class NoSchema(BaseTool):
    pass


class Broken(BaseTool):
    default_schema = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object"}}}

    def __init__(self, config, tool_schema):
        raise RuntimeError("cannot start")


def add(a: int, b: int = 0) -> int:
    """Add two numbers."""
    return a + b
'''


SCHEMA_ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Upper-case a text",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


SCHEMA_SUBMIT = {
    "type": "function",
    "function": {
        "name": "submit",
        "description": "Submit the answer",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string"}},
            "required": ["answer"],
        },
    },
}


@pytest.fixture
def tool_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module of tool classes (unique name per test: imports are cached)."""
    name = f"my_tools_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def write_yaml(path: Path, tools: list[dict]) -> str:
    import yaml

    path.write_text(yaml.safe_dump({"tools": tools}))
    return str(path)


def test_load_verl_yaml_and_run(tmp_path: Path, tool_module: str) -> None:
    path = write_yaml(
        tmp_path / "tools.yaml",
        [
            {"class_name": f"{tool_module}.Echo", "config": {"type": "native"}, "tool_schema": SCHEMA_ECHO},
            {
                "class_name": f"{tool_module}.VerlStyle",
                "config": {"type": "native"},
                "tool_schema": SCHEMA_SUBMIT,
            },
            {
                "class_name": "spmdrl.tools.builtin.CalculatorTool",
                "config": {"type": "native", "max_digits": 5},
            },
            {"function": f"{tool_module}:add"},
        ],
    )
    tools = load_tools([path])
    assert list(tools) == ["echo", "submit", "calculator", "add"]
    assert [s["function"]["name"] for s in tool_schemas(tools)] == list(tools)
    assert tool_schemas(tools)[0] == SCHEMA_ECHO
    assert tools["calculator"].limits.max_digits == 5  # type: ignore[attr-defined]

    ex = ToolExecutor(tools, max_parallel_calls=4, tool_timeout_s=5)
    kwargs = {
        "echo": {"create_kwargs": {"ground_truth": "hi"}},
        "submit": {"create_kwargs": {"ground_truth": "42"}},
    }
    calls = [
        ToolCall("echo", {"text": "hi"}),
        ToolCall("submit", {"answer": "42"}),
        ToolCall("submit", {"answer": "41"}),
        ToolCall("calculator", {"expression": "10**6"}),
        ToolCall("add", {"a": 2, "b": 3}),
    ]
    out = ex.run(calls, [kwargs] * len(calls))
    assert [o.status for o in out] == ["ok", "ok", "ok", "error", "ok"]
    assert [o.text for o in out] == [
        "HI",
        "answer 42 is right",
        "answer 41 is wrong",
        "Error: the result would have about 7 digits, more than 5",
        "5",
    ]
    assert [o.reward for o in out] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert out[0].metrics == {"n": 1.0}
    assert tools["echo"].instances == {}  # type: ignore[attr-defined]  # released
    assert tools["submit"].obj.live == {}  # type: ignore[attr-defined]


def test_load_by_file_path_and_builtin_short_names(tmp_path: Path) -> None:
    path = tmp_path / "file_tools.py"
    path.write_text(TOOL_MODULE)
    yaml_path = write_yaml(
        tmp_path / "t.yml",
        [{"class_name": f"{path}:Echo", "tool_schema": SCHEMA_ECHO}, {"class_name": "python"}],
    )
    tools = load_tools(["calculator", yaml_path, f"{path}:add"])
    assert list(tools) == ["calculator", "echo", "python", "add"]
    assert isinstance(tools["calculator"], CalculatorTool) and isinstance(tools["python"], PythonTool)


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"class_name": "no_such_pkg_xyz.Tool", "tool_schema": SCHEMA_ECHO},
            "no module named 'no_such_pkg_xyz'",
        ),
        ({"class_name": "{mod}.Missing", "tool_schema": SCHEMA_ECHO}, "has no attribute 'Missing'"),
        ({"class_name": "{mod}.add", "tool_schema": SCHEMA_ECHO}, "is a function, not a class"),
        ({"class_name": "{mod}.NoSchema"}, "needs a tool_schema"),
        ({"class_name": "{mod}.Broken"}, "raised RuntimeError: cannot start"),
        (
            {"class_name": "{mod}.Echo", "tool_schema": {"type": "function"}},
            "tool_schema.function is missing",
        ),
        (
            {
                "class_name": "{mod}.Echo",
                "tool_schema": {"type": "function", "function": {"description": "x"}},
            },
            "function.name must be",
        ),
        (
            {
                "class_name": "{mod}.Echo",
                "tool_schema": {"type": "function", "function": {"name": "has space"}},
            },
            "function.name must be",
        ),
        ({"class_name": "{mod}.Echo", "tool_schema": {"function": {"name": "e"}}}, "type must be 'function'"),
        (
            {
                "class_name": "{mod}.Echo",
                "tool_schema": {
                    "type": "function",
                    "function": {"name": "e", "parameters": {"type": "array"}},
                },
            },
            "parameters must be a JSON schema with type 'object'",
        ),
        (
            {
                "class_name": "{mod}.Echo",
                "tool_schema": {
                    "type": "function",
                    "function": {"name": "e", "parameters": {"type": "object", "required": ["x"]}},
                },
            },
            "undeclared properties",
        ),
        (
            {"class_name": "{mod}.Echo", "config": {"type": "mcp"}, "tool_schema": SCHEMA_ECHO},
            "only 'native'",
        ),
        ({"class_name": "calculator", "config": {"max_digit": 3}}, "unknown config keys ['max_digit']"),
        ({"class_name": "python", "config": {"timeout_s": -1}}, "timeout_s must be"),
        ({"class_name": "{mod}.Echo", "tool_schema": SCHEMA_ECHO, "schema": {}}, "unknown keys ['schema']"),
        ({"function": "{mod}:add", "class_name": "{mod}.Echo"}, "exactly one of class_name"),
        ({"function": "{mod}:Echo"}, "not a function"),
    ],
)
def test_bad_tool_configs_are_config_errors(
    tmp_path: Path, tool_module: str, entry: dict, message: str
) -> None:
    entry = {k: v.format(mod=tool_module) if isinstance(v, str) else v for k, v in entry.items()}
    with pytest.raises(ConfigError, match="tools\\[0\\]") as info:
        load_tools([write_yaml(tmp_path / "bad.yaml", [entry])])
    assert message in str(info.value)


def test_duplicate_tool_names_are_config_errors(tmp_path: Path, tool_module: str) -> None:
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        load_tools(["calculator", write_yaml(tmp_path / "t.yaml", [{"class_name": "calculator"}])])
    with pytest.raises(ConfigError, match="two tools are named 'echo'"):
        load_tools(
            [
                write_yaml(
                    tmp_path / "t.yaml",
                    [{"class_name": f"{tool_module}.Echo", "tool_schema": SCHEMA_ECHO}] * 2,
                )
            ]
        )


def test_bad_specs_and_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a built-in"):
        load_tools(["calculater"])
    with pytest.raises(ConfigError, match="cannot be read"):
        load_tools([str(tmp_path / "missing.yaml")])
    (tmp_path / "list.yaml").write_text("- class_name: calculator\n")
    with pytest.raises(ConfigError, match="must be a mapping with a 'tools' list"):
        load_tools([str(tmp_path / "list.yaml")])
    (tmp_path / "bad.yaml").write_text("tools: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_tools([str(tmp_path / "bad.yaml")])
    with pytest.raises(ConfigError, match="no such file"):
        load_tools([f"{tmp_path}/nope.py:fn"])


# -------------------------------------------------------------------------------------- function tools


def test_function_tools_run_with_create_kwargs(functions_file: Path) -> None:
    tools = load_tools(
        [f"{functions_file}:weather", f"{functions_file}:fails", f"{functions_file}:returns_bytes"]
    )
    ex = ToolExecutor(tools)
    out = ex.run(
        [
            ToolCall("weather", {"city": "Oslo", "unit": "F"}),
            ToolCall("weather", {"city": "Oslo", "unit": "K"}),
            ToolCall("weather", {"city": "Oslo", "create_kwargs": {}}),  # not the model's to set
            ToolCall("fails", {"x": 0}),
            ToolCall("fails", {"x": 2}),
            ToolCall("weather", {"days": "two", "city": 1}),
            ToolCall("returns_bytes", {}),
        ],
        [{"weather": {"create_kwargs": {"truth": "rain"}}}] * 7,
    )
    assert out[0].status == "ok"
    assert json.loads(out[0].text) == {"city": "Oslo", "days": 1, "unit": "F", "truth": "rain"}
    assert out[1].status == "invalid" and "argument 'unit' must be one of ['C', 'F'], got 'K'" in out[1].text
    assert out[2].status == "error" and "unexpected argument 'create_kwargs'" in out[2].text
    assert (out[3].status, out[3].text) == ("error", "Error: tool 'fails' raised ValueError: x must not be 0")
    assert "Traceback" in out[3].detail
    assert (out[4].status, out[4].text) == ("error", "Error: 2 is not allowed")
    assert out[5].status == "invalid"
    assert (
        "argument 'city' must be string" in out[5].text and "argument 'days' must be integer" in out[5].text
    )
    assert out[6].status == "ok" and out[6].text == "\"b'x'\""  # JSON of its str()
