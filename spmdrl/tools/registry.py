"""Tools by name: the built-ins, verl tool YAML files, and plain Python functions.

:func:`load_tools` takes a list of specs, each one of:

- ``"calculator"``, ``"python"``: a built-in (:mod:`spmdrl.tools.builtin`) with default limits;
- ``"path/to/tools.yaml"``: verl's tool config file (``tools: [{class_name, config, tool_schema}]``;
  an entry may instead give ``function: "pkg.mod:fn"``, with an optional ``tool_schema``);
- ``"my_pkg.my_mod:fn"`` or ``"path/to/file.py:fn"``: a function, its schema derived from its
  signature and docstring (:func:`spmdrl.tools.schema.function_schema`);
- a mapping: one entry as in the YAML file.

Every problem (an unknown class, a missing or malformed schema, two tools with one name) is a
ConfigError naming the spec and the field, raised at start rather than at the first call.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from spmdrl.errors import ConfigError
from spmdrl.tools.base import (
    BaseTool,
    Tool,
    ToolError,
    ToolResult,
    ToolSchema,
    as_tool,
    plain_schema,
    resolve,
    tool_name,
)
from spmdrl.tools.builtin import BUILTIN_TOOLS
from spmdrl.tools.loading import load_object
from spmdrl.tools.schema import check_schema, function_schema

# A function parameter with this name is not shown to the model: it receives the call's create_kwargs
# (the data row's tools_kwargs[<tool>].create_kwargs, e.g. a ground truth).
CREATE_KWARGS_PARAM = "create_kwargs"
_ENTRY_KEYS = ("class_name", "function", "config", "tool_schema")


class FunctionTool(BaseTool):
    """A Python function as a tool: called with the arguments as keywords. It may return a str, a
    :class:`ToolResult`, or anything JSON-serializable (sent as JSON); it may raise
    :class:`ToolError` to send the model an error message."""

    def __init__(self, fn: Callable[..., Any], schema: Mapping[str, Any], spec: str = "") -> None:
        super().__init__({}, schema)
        self.fn = fn
        self.spec = spec or getattr(fn, "__qualname__", repr(fn))
        self._signature = inspect.signature(fn)
        self._wants_create_kwargs = CREATE_KWARGS_PARAM in self._signature.parameters

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        kwargs = dict(arguments)
        if CREATE_KWARGS_PARAM in kwargs:  # the data's, not the model's to set
            raise ToolError(
                f"invalid arguments for tool {self.name!r}: unexpected argument {CREATE_KWARGS_PARAM!r}"
            )
        if self._wants_create_kwargs:
            kwargs[CREATE_KWARGS_PARAM] = self.instances.get(instance_id, {})
        try:
            self._signature.bind(**kwargs)
        except TypeError as e:
            raise ToolError(f"invalid arguments for tool {self.name!r}: {e}") from None
        value = resolve(self.fn(**kwargs))
        if isinstance(value, ToolResult):
            return value
        if value is None:
            return ToolResult("")
        if isinstance(value, str):
            return ToolResult(value)
        return ToolResult(json.dumps(value, ensure_ascii=False, default=str))

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r}, {self.spec})"


def load_function_tool(spec: str, tool_schema: Mapping[str, Any] | None = None) -> FunctionTool:
    """The function ``spec`` names, as a tool; ``tool_schema`` given replaces the derived one."""
    where = f"function tool {spec!r}"
    fn = load_object(spec, key="function tool")
    if not callable(fn) or inspect.isclass(fn):
        raise ConfigError(f"{where} is a {type(fn).__name__}, not a function (classes go in class_name)")
    if tool_schema is None:
        schema = function_schema(fn, hidden=(CREATE_KWARGS_PARAM,))
    else:
        schema = plain_schema(tool_schema)
        check_schema(schema, where)
    return FunctionTool(fn, schema, spec)


def load_tool_class(
    class_name: str, config: Mapping[str, Any] | None, tool_schema: Mapping[str, Any] | None, where: str
) -> Tool:
    """``Cls(config=..., tool_schema=...)`` as verl builds it, then checked as a :class:`Tool`."""
    config = dict(config or {})
    kind = config.get("type", "native")
    if kind != "native":
        raise ConfigError(
            f"{where}: config.type {kind!r} is not supported; only 'native' tools (verl's MCP tools are not)"
        )
    cls = BUILTIN_TOOLS.get(class_name) or load_object(class_name, key=f"{where}: class_name")
    if not inspect.isclass(cls):
        raise ConfigError(f"{where}: class_name {class_name!r} is a {type(cls).__name__}, not a class")
    if tool_schema is not None:
        check_schema(plain_schema(tool_schema), where)
    try:
        obj = cls(
            config=config, tool_schema=None if tool_schema is None else ToolSchema(plain_schema(tool_schema))
        )
    except ConfigError as e:  # a built-in's bad config: name the entry too
        raise ConfigError(f"{where}: {e}") from e
    except Exception as e:
        raise ConfigError(
            f"{where}: {class_name}(config=..., tool_schema=...) raised {type(e).__name__}: {e}"
        ) from e
    try:
        tool = as_tool(obj)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e
    check_schema(tool.schema, where)
    return tool


def _load_entry(entry: Any, where: str) -> Tool:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be a mapping with class_name (or function), config, tool_schema")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {', '.join(_ENTRY_KEYS)}")
    if ("class_name" in entry) == ("function" in entry):
        raise ConfigError(
            f"{where}: give exactly one of class_name (a tool class) and function (a function path)"
        )
    schema = entry.get("tool_schema")
    if "tool_schema" in entry and not isinstance(schema, Mapping):
        raise ConfigError(f"{where}: tool_schema must be a mapping, got {type(schema).__name__}")
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where}: config must be a mapping, got {type(config).__name__}")
    if "function" in entry:
        if set(config) - {"type"}:
            raise ConfigError(f"{where}: a function tool takes no config (got keys {sorted(config)})")
        if not isinstance(entry["function"], str):
            raise ConfigError(f"{where}: function must be a string 'pkg.mod:fn' or 'path/to/file.py:fn'")
        try:
            return load_function_tool(entry["function"], schema)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from e
    if not isinstance(entry["class_name"], str):
        raise ConfigError(f"{where}: class_name must be a string 'pkg.mod.ClassName'")
    return load_tool_class(entry["class_name"], config, schema, where)


def load_tools_yaml(path: str | Path) -> list[Tool]:
    """The tools of a verl tool config file (``tools: [...]``), in order."""
    import yaml

    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"tool config {str(path)!r} cannot be read: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"tool config {str(path)!r} is not valid YAML: {e}") from e
    if not isinstance(data, Mapping) or not isinstance(data.get("tools"), list):
        raise ConfigError(f"tool config {str(path)!r} must be a mapping with a 'tools' list")
    tools = [_load_entry(e, f"tool config {str(path)!r}, tools[{i}]") for i, e in enumerate(data["tools"])]
    _check_unique([(t, f"{path}: tools[{i}]") for i, t in enumerate(tools)])
    return tools


def load_tools(specs: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]]) -> dict[str, Tool]:
    """Every tool the specs name (see the module docstring), by tool name."""
    if isinstance(specs, str | Mapping):
        specs = [specs]
    loaded: list[tuple[Tool, str]] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, Mapping):
            loaded.append((_load_entry(spec, f"tools[{i}]"), f"tools[{i}]"))
            continue
        if not isinstance(spec, str):
            raise ConfigError(f"tools[{i}] must be a string or a mapping, got {type(spec).__name__}")
        spec = spec.strip()
        if spec in BUILTIN_TOOLS:
            loaded.append((load_tool_class(spec, {}, None, f"tool {spec!r}"), spec))
        elif spec.endswith((".yaml", ".yml")):
            loaded += [(t, spec) for t in load_tools_yaml(spec)]
        elif ":" in spec:
            loaded.append((load_function_tool(spec), spec))
        else:
            raise ConfigError(
                f"tool {spec!r} is neither a built-in ({', '.join(BUILTIN_TOOLS)}), a tool YAML file "
                "(.yaml), nor a function 'my_pkg.my_mod:fn' / 'path/to/file.py:fn'"
            )
    _check_unique(loaded)
    return {tool_name(t.schema): t for t, _ in loaded}


def _check_unique(loaded: Sequence[tuple[Tool, str]]) -> None:
    seen: dict[str, str] = {}
    for tool, source in loaded:
        name = tool_name(tool.schema)
        if name in seen:
            raise ConfigError(
                f"two tools are named {name!r} (from {seen[name]} and from {source}); rename one "
                "with its tool_schema.function.name"
            )
        seen[name] = source


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The schemas in order, for ``tokenizer.apply_chat_template(messages, tools=...)``."""
    return [plain_schema(t.schema) for t in tools.values()]
