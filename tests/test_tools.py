"""Tools for multi-turn rollouts: the call parser, tool loading (verl YAML, functions), the built-in
calculator and python runner (with real child processes), and the executor's bounds."""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
from pathlib import Path

import pytest

from spmdrl.config import ConfigError
from spmdrl.tools import (
    ParseResult,
    ToolCall,
    ToolCallOutcome,
    ToolError,
    ToolExecutor,
    ToolResult,
    get_parser,
    load_function_tool,
    load_tools,
    parse,
    register_parser,
    summarize,
    tool_schemas,
    truncate_text,
    truncate_tokens,
)
from spmdrl.tools.arith import ArithLimits, ArithmeticRefused, evaluate, format_number
from spmdrl.tools.base import ToolSchema
from spmdrl.tools.builtin import CalculatorTool, PythonTool
from spmdrl.tools.parser import PARSERS
from spmdrl.tools.pyexec import PythonLimits, run_python
from spmdrl.tools.schema import function_schema, validate_arguments


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --------------------------------------------------------------------------------------------- parser


def test_parse_single_call_with_text_around() -> None:
    r = parse(f"Let me compute.\n{call('calculator', expression='3*7')}\nDone.")
    assert r.calls == [ToolCall("calculator", {"expression": "3*7"})]
    assert r.content == "Let me compute.\n\nDone."
    assert r.errors == []


def test_parse_several_calls_in_order() -> None:
    r = parse(call("a", x=1) + "\n" + call("b") + call("a", x=2, nested={"k": [1, 2]}))
    assert [c.name for c in r.calls] == ["a", "b", "a"]
    assert r.calls[1].arguments == {}
    assert r.calls[2].arguments == {"x": 2, "nested": {"k": [1, 2]}}
    assert r.content == ""


def test_parse_no_calls_is_all_content() -> None:
    assert parse("  The answer is 4.  ") == ParseResult(calls=[], content="The answer is 4.", errors=[])


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
        ("{'name': 'a'}", "not valid JSON"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": 3}', 'no "name"'),
        ('{"name": "a", "arguments": [1, 2]}', '"arguments" must be a JSON object, got list'),
        ('{"name": "a", "arguments": "x=1"}', '"arguments" must be a JSON object, got a string'),
        ('["a", {}]', "expected a JSON object"),
    ],
)
def test_parse_malformed_call_is_an_error_and_others_still_parse(body: str, message: str) -> None:
    r = parse(f"x <tool_call>{body}</tool_call> {call('ok', v=1)}")
    assert r.calls == [ToolCall("ok", {"v": 1})]
    assert len(r.errors) == 1 and r.errors[0].startswith("tool call 1: ") and message in r.errors[0], r.errors
    assert r.content == "x"


def test_parse_closing_tag_inside_a_json_string() -> None:
    code = "print('</tool_call>')"
    r = parse(call("python", code=code) + " after")
    assert r.calls == [ToolCall("python", {"code": code})] and not r.errors and r.content == "after"
    r = parse('<tool_call>{"name": "a"} extra</tool_call>' + call("b"))
    assert r.calls == [ToolCall("b", {})] and r.errors == [
        'tool call 1: text after the JSON object: \'{"name": "a"} extra\''
    ]


def test_parse_arguments_encoded_as_a_json_string_are_accepted() -> None:
    r = parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert r.calls == [ToolCall("a", {"x": 1})] and not r.errors


def test_parse_unclosed_and_stray_tags() -> None:
    r = parse(f'{call("a")} then <tool_call>\n{{"name": "b", "argu')  # cut off by the length limit
    assert r.calls == [ToolCall("a", {})]
    assert r.errors == ["tool call 2: <tool_call> is never closed by </tool_call>"]
    assert r.content == "then"
    r = parse("oops </tool_call> " + call("a"))
    assert r.calls == [ToolCall("a", {})] and r.errors == ["a </tool_call> without a <tool_call> before it"]


def test_parse_never_raises_on_garbage() -> None:
    for text in ["", "<tool_call>", "</tool_call>" * 3, "<tool_call>" * 3 + "</tool_call>", "[" * 100_000]:
        assert isinstance(parse(text), ParseResult)
    deep = "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>"
    assert parse(deep).errors and not parse(deep).calls


def test_register_and_load_parsers(tmp_path: Path) -> None:
    def upper(text: str) -> ParseResult:
        return ParseResult(calls=[ToolCall(text.upper(), {})])

    register_parser("test_upper", upper)
    try:
        assert parse("x", parser="test_upper").calls == [ToolCall("X", {})]
    finally:
        del PARSERS["test_upper"]
    path = tmp_path / "my_parser.py"
    path.write_text(
        textwrap.dedent(
            """
            from spmdrl.tools.parser import ParseResult, ToolCall

            def parse(text):
                if text == "boom":
                    raise RuntimeError("bad parser")
                if text == "wrong":
                    return "not a ParseResult"
                return ParseResult(calls=[ToolCall("echo", {"text": text})])
            """
        )
    )
    p = get_parser(f"{path}:parse")
    assert p("hi").calls == [ToolCall("echo", {"text": "hi"})]
    assert "raised RuntimeError: bad parser" in p("boom").errors[0]  # a user parser's bug never raises
    assert "not a ParseResult" in p("wrong").errors[0]
    with pytest.raises(ConfigError, match="neither a registered parser"):
        get_parser("llama3_json")
    with pytest.raises(ConfigError, match="no module named"):
        get_parser("no_such_module_xyz:parse")


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


def test_tool_schema_reads_like_verls_pydantic_schema() -> None:
    schema = ToolSchema(SCHEMA_ECHO)
    assert schema.function.name == "echo" and schema.function.parameters.required == ["text"]
    assert schema.model_dump() == SCHEMA_ECHO and type(schema.model_dump()) is dict
    with pytest.raises(AttributeError):
        _ = schema.function.nothing


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


# ----------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2**100", "1267650600228229401496703205376"),
        ("2**100 + 1 - 2**100", "1"),  # exact: no float rounding
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("6 / 3", "2"),  # integers that divide evenly stay integers
        ("10**30 / 5", "200000000000000000000000000000"),
        ("7 / 2", "3.5"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** -2", "0.25"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("2 ** 0.5", "1.4142135623731"),
        ("1e3 * 2", "2000"),
        ("3 × 4 ÷ 2 − 1", "5"),  # the symbols models write
        ("1" + "+1" * 400, "401"),  # long sums nest deep
    ],
)
def test_calculator_arithmetic(expression: str, expected: str) -> None:
    assert format_number(evaluate(expression)) == expected


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os').system('true')", "a function call is not allowed"),
        ("(1, 2)", "tuple syntax is not allowed"),
        ("().__class__", "attribute access (.__class__)"),
        ("(1).__class__", "attribute access (.__class__)"),
        ("x + 1", "the name 'x'"),
        ("'a' * 3", "only numbers are allowed, not str"),
        ("True + 1", "only numbers are allowed, not bool"),
        ("1j * 2", "only numbers are allowed, not complex"),
        ("[1, 2][0]", "not allowed"),
        ("1 < 2", "compare syntax is not allowed"),
        ("lambda: 1", "not allowed"),
        ("2 ^ 3", "'^' is not a power here"),
        ("1 << 100", "the operator LShift"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9**9**9", "exponent 387420489 is larger than 10000"),
        ("2**10**10", "larger than 10000"),
        ("7**5000", "about 4226 digits"),
        ("(10**999) * (10**999)", "more than 1000 digits"),
        ("10.0 ** 400", "too large for a float"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** (1/3)", "complex number"),
        ("", "empty"),
        ("1 +", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
        ("1+" * 600 + "1", "longer than 1000 characters"),
    ],
)
def test_calculator_refuses_quickly(expression: str, reason: str) -> None:
    start = time.monotonic()
    with pytest.raises(ArithmeticRefused) as info:
        evaluate(expression)
    assert reason in str(info.value)
    assert time.monotonic() - start < 0.5


def test_calculator_limits_are_configurable() -> None:
    assert evaluate("2**20", ArithLimits(max_exponent=20)) == 2**20
    with pytest.raises(ArithmeticRefused, match="nested deeper than 3"):
        evaluate("1+1+1+1+1", ArithLimits(max_depth=3))
    tool = CalculatorTool({"type": "native", "max_digits": 3})
    assert tool.execute("i", {"expression": "999 + 0"}).text == "999"
    with pytest.raises(ToolError, match="more than 3 digits"):
        tool.execute("i", {"expression": "999 + 1"})


# ---------------------------------------------------------------------------------------- python tool


def test_python_output_errors_and_exit_codes() -> None:
    r = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.returncode, r.timed_out) == ("out\n", "err\n", 0, False)
    assert r.text() == "out\nerr"
    r = run_python("x = 1\n1 / x0")
    assert r.returncode == 1
    assert r.text().startswith('Traceback (most recent call last):\n  File "main.py", line 2, in <module>\n')
    assert "NameError: name 'x0' is not defined" in r.text()
    assert "spmdrl" not in r.text()  # the runner's own frame is not shown
    assert 'File "main.py", line 1' in run_python("def f(:\n  pass").text()
    assert run_python("import sys; sys.exit(3)").text() == "(exit code 3)"
    assert run_python("x = 1").text() == "(no output)"
    assert "killed by SIGSEGV" in run_python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)").text()
    assert run_python("if __name__ == '__main__': print(__file__)").text() == "main.py"
    tool = PythonTool({"timeout_s": 5})
    result = tool.execute("i", {"code": "print(6 * 7)"})
    assert result.text == "42" and result.metrics["timed_out"] == 0.0 and result.metrics["failed"] == 0.0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped yet
    except FileNotFoundError:
        return False


def _wait_dead(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_python_timeout_kills_grandchildren(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(
        f"""
        import subprocess, time
        child = subprocess.Popen(["sleep", "1000"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(1000)
        """
    )
    start = time.monotonic()
    r = run_python(code, PythonLimits(timeout_s=0.7))
    assert time.monotonic() - start < 2.5
    assert (
        r.timed_out
        and r.text() == "started\nError: the code ran past its time limit of 0.7 s and was killed."
    )
    assert _wait_dead(int(pid_file.read_text()))


def test_python_leftover_background_process_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = (
        f"import subprocess; open({str(pid_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '1000']).pid))"
    )
    start = time.monotonic()
    r = run_python(code, PythonLimits(timeout_s=5))
    assert not r.timed_out and r.returncode == 0 and time.monotonic() - start < 2
    assert _wait_dead(int(pid_file.read_text()))


def test_python_memory_and_file_size_limits() -> None:
    r = run_python("x = bytearray(2 << 30)\nprint('allocated')", PythonLimits(memory_mb=256))
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert r.text().endswith("(the memory limit is 256 MiB)")
    r = run_python("open('big', 'wb').write(b'x' * (2 << 20))", PythonLimits(file_size_mb=1))
    assert "File too large" in r.stderr and r.returncode == 1
    # numpy's import fits the default limit (thread pools of one)
    assert run_python("import numpy; print(numpy.ones(3).sum())").text() == "3.0"


@pytest.mark.slow
def test_python_cpu_limit() -> None:
    start = time.monotonic()
    r = run_python("while True: pass", PythonLimits(cpu_s=1, timeout_s=30))
    assert not r.timed_out and time.monotonic() - start < 15  # 1 s of CPU: longer on a busy machine
    assert r.text() == "Error: the code used more than 1 s of CPU time and was killed."


def test_python_temp_dir_removed_and_environment_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("SPMDRL_TEST_SECRET", "hunter2")
    code = textwrap.dedent(
        """
        import os
        print(os.getcwd())
        print(sorted(os.listdir(".")))
        os.makedirs("locked/inner")
        open("locked/inner/f", "w").write("x")
        os.chmod("locked/inner", 0)
        os.chmod("locked", 0)
        print(os.environ.get("SPMDRL_TEST_SECRET"), os.environ["CUDA_VISIBLE_DEVICES"] == "", os.environ["HOME"] == os.getcwd())
        """
    )
    r = run_python(code, PythonLimits(tmp_root=str(root)))
    cwd, listing, env = r.stdout.splitlines()
    assert Path(cwd).parent == root and listing == "['main.py']"
    assert env == "None True True"
    assert list(root.iterdir()) == []  # removed, chmod 000 directories included


def test_python_output_truncated() -> None:
    r = run_python(
        "import sys\nprint('a' * 10_000)\nprint('e' * 5000 + 'END', file=sys.stderr)",
        PythonLimits(max_output_chars=100),
    )
    assert r.stdout == "a" * 100 and r.stdout_dropped == 10_001 - 100
    assert r.stderr.endswith("END\n") and len(r.stderr) == 100
    assert r.text().startswith(
        "a" * 100 + "\n[... 9901 more bytes of output]\n[... 4904 earlier bytes of stderr]\n"
    )
    r = run_python("print('é' * 50)", PythonLimits(max_output_chars=10))
    assert r.stdout == "é" * 10 and r.stdout_dropped == 101 - 20


# ------------------------------------------------------------------------------------------- executor


class Sleeper:
    """A synchronous tool without BaseTool: records how many of its calls overlap."""

    schema = {
        "type": "function",
        "function": {
            "name": "sleep",
            "parameters": {"type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]},
        },
    }

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = self.peak = 0
        self.created: list[dict] = []
        self.released: list[str] = []

    def create(self, instance_id: str, **kwargs: object) -> str:
        self.created.append(dict(kwargs))
        return instance_id

    def execute(self, instance_id: str, arguments: dict) -> str:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            if arguments.get("raise"):
                raise KeyError("boom")
            time.sleep(arguments["s"])
            return f"slept {arguments['s']}"
        finally:
            with self.lock:
                self.active -= 1

    def release(self, instance_id: str) -> None:
        self.released.append(instance_id)


def test_executor_bounds_parallelism() -> None:
    tool = Sleeper()
    ex = ToolExecutor([tool], max_parallel_calls=2, tool_timeout_s=5)
    start = time.monotonic()
    out = ex.run([ToolCall("sleep", {"s": 0.3})] * 4)
    elapsed = time.monotonic() - start
    assert [o.status for o in out] == ["ok"] * 4 and all(o.text == "slept 0.3" for o in out)
    assert tool.peak == 2
    assert 0.58 <= elapsed < 1.15, elapsed  # two rounds of two; one at a time would take 1.2 s
    assert all(0.29 <= o.latency_s < 0.8 for o in out)
    assert len(tool.released) == 4 and tool.created == [{"create_kwargs": {}}] * 4


def test_executor_timeout_frees_the_slot_and_is_counted() -> None:
    tool = Sleeper()
    ex = ToolExecutor([tool], max_parallel_calls=1, tool_timeout_s=0.3)
    start = time.monotonic()
    out = ex.run([ToolCall("sleep", {"s": 2}), ToolCall("sleep", {"s": 0.05})])
    assert time.monotonic() - start < 0.9
    assert out[0].status == "timeout" and out[0].text == "Error: tool 'sleep' timed out after 0.3 s"
    assert out[0].latency_s == 0.3
    assert out[1].status == "ok"
    assert ex.abandoned_threads == 1  # the first call's thread sleeps on
    stats = summarize(out)
    assert stats["tools/timeout"] == 1 and stats["tools/ok"] == 1 and stats["tools/calls"] == 2


def test_executor_counts_errors_and_never_raises() -> None:
    class BadTool:
        schema = {
            "type": "function",
            "function": {"name": "bad", "parameters": {"type": "object", "properties": {}}},
        }

        def create(self, instance_id: str, **kwargs: object) -> None:
            if kwargs["create_kwargs"].get("fail_create"):
                raise RuntimeError("create failed")

        def execute(self, instance_id: str, arguments: dict) -> object:
            if arguments.get("exit"):
                raise SystemExit(2)
            if arguments.get("nan"):
                return ToolResult("x", reward=float("nan"))
            return 42  # not a tool result

        def release(self, instance_id: str) -> None:
            raise OSError("release failed")  # logged; the result stands

    tool = Sleeper()
    ex = ToolExecutor([tool, BadTool()], max_parallel_calls=3, tool_timeout_s=2)
    parsed = parse(call("sleep", s=0, **{"raise": True}) + call("bad") + "<tool_call>{</tool_call>")
    out = ex.run(
        parsed.calls + [ToolCall("bad", {"exit": True}), ToolCall("bad", {"nan": True}), ToolCall("bad", {})],
        [None, None, None, None, {"bad": {"create_kwargs": {"fail_create": True}}}],
    )
    out += [ToolCallOutcome.parse_error(e) for e in parsed.errors]
    assert [o.status for o in out] == ["error"] * 5 + ["parse_error"]
    assert out[0].text == "Error: tool 'sleep' raised KeyError: 'boom'"
    assert out[1].text.startswith("Error: tool 'bad' raised TypeError: a tool returned int")
    assert out[2].text == "Error: tool 'bad' raised SystemExit: 2"
    assert "expected a finite number" in out[3].text
    assert out[4].text == "Error: tool 'bad' raised RuntimeError: create failed"
    assert out[5].text.startswith("Error: tool call 3: not valid JSON")
    assert out[5].message() == {"role": "tool", "content": out[5].text}
    stats = summarize(out)
    assert (stats["tools/calls"], stats["tools/error"], stats["tools/parse_error"], stats["tools/ok"]) == (
        6,
        5,
        1,
        0,
    )
    assert ex.run([]) == []


def test_executor_runs_python_calls_in_parallel() -> None:
    ex = ToolExecutor(load_tools(["python"]), max_parallel_calls=4, tool_timeout_s=10)
    start = time.monotonic()
    out = ex.run(
        [ToolCall("python", {"code": f"import time; time.sleep(0.4); print({i})"}) for i in range(4)]
    )
    assert [o.text for o in out] == ["0", "1", "2", "3"]
    assert time.monotonic() - start < 1.5  # not 4 x 0.4 s one after another
    stats = summarize(out)
    assert stats["tools/python/timed_out"] == 0 and stats["tools/python/wall_s"] >= 0.4


@pytest.mark.parametrize(
    "side, marker, expected",
    [
        ("left", [], [0, 1, 2, 3, 4, 5]),
        ("right", [], [4, 5, 6, 7, 8, 9]),
        ("middle", [], [0, 1, 2, 7, 8, 9]),
        ("left", [-1], [0, 1, 2, 3, 4, -1]),
        ("right", [-1], [-1, 5, 6, 7, 8, 9]),
        ("middle", [-1, -2], [0, 1, -1, -2, 8, 9]),
        ("middle", [-1], [0, 1, 2, -1, 8, 9]),
        ("middle", [-1] * 6, [0, 1, 2, 7, 8, 9]),  # no room for the marker
    ],
)
def test_truncate_tokens(side: str, marker: list[int], expected: list[int]) -> None:
    assert truncate_tokens(list(range(10)), 6, side, marker) == expected  # type: ignore[arg-type]


def test_truncate_edges() -> None:
    assert truncate_tokens([1, 2, 3], 3, "middle", [9]) == [1, 2, 3]
    assert truncate_tokens([1, 2, 3], 0) == []
    assert truncate_tokens(range(5), 1, "middle") == [0]
    with pytest.raises(ValueError, match="side"):
        truncate_tokens([1], 0, "top")  # type: ignore[arg-type]
    assert truncate_text("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert truncate_text("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert truncate_text("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert truncate_text("abc", 4) == "abc"


def test_executor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_parallel_calls"):
        ToolExecutor([], max_parallel_calls=0)
    with pytest.raises(ValueError, match="tool_timeout_s"):
        ToolExecutor([], tool_timeout_s=0)
    with pytest.raises(TypeError, match="it has no create, execute, release method"):
        ToolExecutor([object()])


def test_environment_is_not_modified() -> None:
    before = dict(os.environ)
    run_python("print(1)")
    assert dict(os.environ) == before
