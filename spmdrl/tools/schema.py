"""Tool schemas (OpenAI function format): derived from a Python function, checked when loaded, and
used to check a call's arguments before the tool runs.

A derived schema, for ``def lookup(city: str, days: int = 1) -> str`` with a Google-style docstring::

    {"type": "function", "function": {"name": "lookup", "description": "<docstring summary>",
     "parameters": {"type": "object",
                    "properties": {"city": {"type": "string", "description": "<from Args:>"},
                                   "days": {"type": "integer", "description": "..."}},
                    "required": ["city"]}}}

Type hints map to JSON schema types: str, int, float, bool, list[T], dict[str, T], Literal[...]
(an enum), ``T | None`` (optional, not required), an Enum class (its values). The argument check
covers what models get wrong in practice (missing or unknown arguments, wrong JSON types, values
outside an enum), not all of JSON Schema.

Why not ``transformers.utils.get_json_schema``: it derives a schema from the same hints, but not the
one our users' functions need (checked against transformers 5.19). It raises unless every parameter
has a description in a Google-style ``Args:`` section in exactly ``name: text`` form (an undocumented
parameter, ``days (int): ...`` or Sphinx ``:param x:`` all fail), where a description here is optional;
it turns hints it does not know (an ``Enum`` class, ``bytes``, a custom class) into
``{"type": "object"}`` without a word, so the model is asked for an object the function cannot take,
where here an Enum gives its values and the rest is a ConfigError at load; ``x: str | None`` without a
default stays required (with a non-standard ``"nullable"``); the description is all text before
``Args:``, not the first paragraph; it adds a ``"return"`` entry, which templates that print the
schema (Qwen's) put in the prompt; and it has no way to hide ``create_kwargs`` or to refuse
positional-only parameters. It checks no arguments either: :func:`validate_arguments` has no
counterpart there.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

from spmdrl.errors import ConfigError

# OpenAI's rule for function names; chat templates and parsers rely on it.
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def function_schema(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    hidden: Collection[str] = (),
) -> dict[str, Any]:
    """The OpenAI function schema of ``fn`` (see the module docstring), without the parameters named
    in ``hidden``. Raises ConfigError for a parameter that cannot be passed by keyword or has no
    (supported) type hint."""
    name = name or getattr(fn, "__name__", "")
    where = f"function tool {name!r}"
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ConfigError(
            f"{where}: cannot read its signature ({type(e).__name__}: {e}); give tool_schema"
        ) from e
    summary, param_docs = _parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in hidden:
            continue  # *args / **kwargs take nothing the model can name
        if p.kind == p.POSITIONAL_ONLY:
            raise ConfigError(
                f"{where}: parameter {p.name!r} is positional-only; tools are called with keywords"
            )
        if p.name not in hints:
            raise ConfigError(f"{where}: parameter {p.name!r} has no type hint; add one or give tool_schema")
        prop, optional = _json_type(hints[p.name], f"{where}: parameter {p.name!r}")
        if p.name in param_docs:
            prop["description"] = param_docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty and not optional:
            required.append(p.name)
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": description if description is not None else summary,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }
    check_schema(schema, where)
    return schema


def _json_type(hint: Any, where: str) -> tuple[dict[str, Any], bool]:
    """(JSON schema of ``hint``, whether it admits None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_type(rest[0], where)[0], len(rest) < len(args)
        raise ConfigError(
            f"{where}: union {hint} is not supported; use one type (or T | None) or give tool_schema"
        )
    if hint is Any:
        return {}, False
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}, False
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _SIMPLE:
            raise ConfigError(f"{where}: Literal values must share one of str, int, float, bool")
        return {"type": _SIMPLE[next(iter(kinds))], "enum": list(args)}, False
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        return _json_type(typing.Literal[tuple(values)], where)[0], False  # type: ignore[misc]
    if origin in (list, tuple, set, frozenset) or origin is typing.Sequence:
        schema: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            schema["items"] = _json_type(args[0], where)[0]
        return schema, False
    if origin in (dict, Mapping) or origin is typing.Mapping:
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = _json_type(args[1], where)[0]
        return schema, False
    raise ConfigError(
        f"{where}: type {hint} has no JSON schema type; use str, int, float, bool, list, dict or give tool_schema"
    )


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph, {parameter: description}) from Google-style ``Args:`` or Sphinx ``:param x:``."""
    paragraphs = doc.strip().split("\n\n")
    summary = " ".join(paragraphs[0].split()) if paragraphs and paragraphs[0] else ""
    params: dict[str, str] = {}
    for m in re.finditer(r"^\s*:param\s+(?:\S+\s+)?(\w+):\s*(.+)$", doc, re.M):
        params[m.group(1)] = m.group(2).strip()
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc, re.M)
    if section:
        current = ""
        for line in section.group(1).splitlines():
            m = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)$", line)
            if m:
                current = m.group(1)
                params[current] = m.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    if summary.startswith((":param", "Args:")):
        summary = ""
    return summary, params


def check_schema(schema: Any, where: str) -> None:
    """Raise ConfigError naming ``where`` and the field when ``schema`` is not an OpenAI function schema."""
    if not isinstance(schema, Mapping):
        raise ConfigError(f"{where}: tool_schema must be a mapping, got {type(schema).__name__}")
    if schema.get("type") != "function":
        raise ConfigError(f"{where}: tool_schema.type must be 'function', got {schema.get('type')!r}")
    fn = schema.get("function")
    if not isinstance(fn, Mapping):
        raise ConfigError(
            f"{where}: tool_schema.function is missing (a mapping with name, description, parameters)"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(
            f"{where}: tool_schema.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}"
        )
    if not isinstance(fn.get("description", ""), str):
        raise ConfigError(f"{where}: tool_schema.function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type") != "object":
        raise ConfigError(
            f"{where}: tool_schema.function.parameters must be a JSON schema with type 'object'"
        )
    props = params.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(v, Mapping) for v in props.values()):
        raise ConfigError(f"{where}: tool_schema.function.parameters.properties must map names to schemas")
    for prop_name, prop in props.items():
        _check_type_field(prop, f"{where}: tool_schema.function.parameters.properties.{prop_name}")
    req = params.get("required", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise ConfigError(f"{where}: tool_schema.function.parameters.required must be a list of names")
    unknown = [r for r in req if r not in props]
    if unknown:
        raise ConfigError(
            f"{where}: tool_schema.function.parameters.required names undeclared properties {unknown}"
        )


def _check_type_field(prop: Mapping[str, Any], where: str) -> None:
    kinds = prop.get("type")
    if kinds is None:
        return
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind not in _JSON_TYPES:
            raise ConfigError(f"{where}.type {kind!r} is not a JSON schema type ({', '.join(_JSON_TYPES)})")


def validate_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` for a tool with ``schema`` (checked by :func:`check_schema`);
    [] when nothing is. Unknown arguments are errors only where ``additionalProperties`` is false."""
    params = schema["function"].get("parameters", {})
    props: Mapping[str, Any] = params.get("properties", {})
    errors = [f"missing required argument {r!r}" for r in params.get("required", []) if r not in arguments]
    if params.get("additionalProperties") is False:
        errors += [
            f"unknown argument {k!r} (expected: {', '.join(props) or 'none'})"
            for k in arguments
            if k not in props
        ]
    for key, value in arguments.items():
        if key in props:
            errors += _check_value(value, props[key], repr(key))
    return errors


def _matches(value: Any, kind: str) -> bool:
    if kind == "integer":  # JSON Schema: any number with no fractional part
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}[kind]
    return isinstance(value, expected)


def _check_value(value: Any, prop: Mapping[str, Any], where: str) -> list[str]:
    kinds = prop.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_matches(value, k) for k in kinds if k in _JSON_TYPES):
            return [
                f"argument {where} must be {' or '.join(kinds)}, got {type(value).__name__} {_short(value)}"
            ]
    if "enum" in prop and value not in prop["enum"]:
        return [f"argument {where} must be one of {prop['enum']}, got {_short(value)}"]
    errors: list[str] = []
    if isinstance(value, list) and isinstance(prop.get("items"), Mapping):
        for i, item in enumerate(value):
            errors += _check_value(item, prop["items"], f"{where}[{i}]")
    if isinstance(value, dict) and isinstance(prop.get("properties"), Mapping):
        for r in prop.get("required", []):
            if r not in value:
                errors.append(f"argument {where} is missing key {r!r}")
        for k, v in value.items():
            if k in prop["properties"]:
                errors += _check_value(v, prop["properties"][k], f"{where}[{k!r}]")
    return errors


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
