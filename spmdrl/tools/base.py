"""What a tool is: the :class:`Tool` protocol, its result, and a base class for writing one.

The shape is verl's (``verl.tools.base_tool.BaseTool``): a tool has an OpenAI function schema, and
for each call the rollout runs ``create(instance_id, create_kwargs=...)``, then
``execute(instance_id, arguments)``, then ``release(instance_id)``. ``create_kwargs`` comes from the
data row (``extra_info.tools_kwargs[<tool name>].create_kwargs``, verl's layout), so a tool can
hold per-sample state such as the ground truth.

The methods are synchronous, unlike verl's ``async`` ones: the executor
(:mod:`spmdrl.tools.executor`) runs each call in a thread of its own, so a tool may block (wait on
a subprocess, a socket) without holding up the others, and the SPMD program has no event loop to
share. A verl-style tool whose methods are ``async`` works too: :func:`as_tool` wraps it, and each
call's coroutine runs to completion in that call's thread (``asyncio.run``: a fresh event loop per
call, so a tool must not keep loop-bound objects, such as an ``aiohttp`` session, across calls).

Tools are called from several threads at once: keep per-call state under ``instance_id`` and
shared state thread-safe.

A tool may return images (``ToolResult.image``, verl's ``ToolResponse.image``: PIL images): a
vision-language model reads them in the tool message, before its text (docs/tools.md#image-observations).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class ToolResult:
    text: str  # what the model reads, as the content of the tool message
    reward: float = 0.0  # a step reward (verl's tool_reward); the rollout decides what to do with it
    metrics: dict[str, float] = field(default_factory=dict)  # logged, averaged per tool
    # Images the model sees in the tool message, before its text (PIL images; verl's ToolResponse.image).
    # Only a vision-language model takes them: with a text model the rollout stops, naming the tool.
    image: list[Any] = field(default_factory=list)


class ToolError(Exception):
    """An expected failure caused by the call (bad arguments, division by zero): its message goes to
    the model as ``"Error: <message>"``, without a traceback in the logs."""


@runtime_checkable
class Tool(Protocol):
    """The interface the executor calls. :class:`BaseTool` implements the bookkeeping."""

    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}

    def create(self, instance_id: str, **kwargs: Any) -> Any: ...

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult: ...

    def release(self, instance_id: str) -> None: ...


def tool_name(schema: Mapping[str, Any]) -> str:
    return str(schema["function"]["name"])


class ToolSchema(dict):
    """A schema dict that also reads like verl's pydantic ``OpenAIFunctionToolSchema``
    (``schema.function.name``, ``schema.model_dump()``), for tool classes written against verl."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return ToolSchema(value) if isinstance(value, dict) and not isinstance(value, ToolSchema) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return plain_schema(self)


def plain_schema(schema: Any) -> dict[str, Any]:
    """A plain dict (deep copy) from a dict, a :class:`ToolSchema` or a pydantic model."""
    if hasattr(schema, "model_dump") and not isinstance(schema, dict):
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    return _plain(schema)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class BaseTool:
    """A tool class loadable from a tool YAML (``class_name``): ``Cls(config=..., tool_schema=...)``.

    Subclasses implement :meth:`execute`, and set ``default_schema`` to make ``tool_schema`` optional
    in the YAML. ``self.instances[instance_id]`` holds each live call's ``create_kwargs``.
    """

    default_schema: dict[str, Any] | None = None

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        schema = tool_schema if tool_schema is not None else self.default_schema
        if schema is None:
            raise ValueError(f"{type(self).__name__} needs a tool_schema (it has no default_schema)")
        self.schema = plain_schema(schema)
        self.name = tool_name(self.schema)
        self.instances: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @property
    def tool_schema(self) -> ToolSchema:  # verl's attribute name
        return ToolSchema(self.schema)

    def create(self, instance_id: str, create_kwargs: Mapping[str, Any] | None = None, **_: Any) -> str:
        with self._lock:
            self.instances[instance_id] = dict(create_kwargs or {})
        return instance_id

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        raise NotImplementedError

    def calc_reward(self, instance_id: str) -> float:  # verl's hook; the executor does not call it
        return 0.0

    def release(self, instance_id: str) -> None:
        with self._lock:
            self.instances.pop(instance_id, None)


def resolve(value: Any) -> Any:
    """``value``, or what it evaluates to when it is awaitable (a verl-style ``async`` method)."""
    if inspect.isawaitable(value):

        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


def coerce_result(value: Any) -> ToolResult:
    """A :class:`ToolResult` from what a tool returned: a ToolResult, a string, verl's
    ``(response, reward, metrics)`` tuple, or verl's ``ToolResponse`` (an object with ``.text`` and
    optionally ``.image``, a PIL image or a list of them). Raises TypeError for anything else (a video).
    Metrics that are not finite numbers are dropped."""
    if isinstance(value, ToolResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        response, reward, metrics = value
        result = ToolResult(
            text=_text(response),
            reward=_finite(reward, "reward") if reward is not None else 0.0,
            metrics=dict(metrics or {}),
            image=_field(response, "image"),
        )
    else:
        result = ToolResult(text=_text(value), image=_field(value, "image"))
    if not isinstance(result.text, str):
        raise TypeError(f"a tool result's text must be a str, got {type(result.text).__name__}")
    result.image = _images(result.image)
    result.reward = _finite(result.reward, "reward")
    result.metrics = {
        str(k): float(v)
        for k, v in result.metrics.items()
        if isinstance(v, numbers.Real) and math.isfinite(float(v))
    }
    return result


def _text(response: Any) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, Mapping) and isinstance(response.get("text", ""), str):
        return response.get("text") or ""
    text = getattr(response, "text", None)
    if isinstance(text, str) or (text is None and hasattr(response, "text")):
        return text or ""
    raise TypeError(
        f"a tool returned {type(response).__name__}; expected a ToolResult, a str, an object with a "
        "'text' string, or a (response, reward, metrics) tuple"
    )


def _field(response: Any, name: str) -> Any:
    """A verl ToolResponse's ``image`` (or a dict's); refuses its ``video``, which nothing here takes."""
    if isinstance(response, str):
        return None
    get = response.get if isinstance(response, Mapping) else lambda k: getattr(response, k, None)
    if get("video"):
        raise TypeError(
            "a tool returned a video (ToolResponse.video): video observations are not supported; return "
            "images (ToolResult.image) or text"
        )
    return get(name)


def _images(value: Any) -> list[Any]:
    """``value`` (None, a PIL image, or a list of them) as a list of RGB PIL images."""
    if value is None:
        return []
    items = list(value) if isinstance(value, list | tuple) else [value]
    out = []
    for i, item in enumerate(items):
        if not callable(getattr(item, "convert", None)) or not hasattr(item, "size"):
            raise TypeError(
                f"a tool result's image {i} is a {type(item).__name__}; expected a PIL image "
                "(PIL.Image.open(...) or Image.new(...))"
            )
        out.append(item if getattr(item, "mode", None) == "RGB" else item.convert("RGB"))
    return out


def _finite(value: Any, what: str) -> float:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise TypeError(f"a tool returned a {what} of {value!r}; expected a finite number")


class _AdaptedTool:
    """A verl-style tool object (``tool_schema`` attribute, ``async`` methods, tuple results) as a
    :class:`Tool`."""

    def __init__(self, obj: Any, schema: dict[str, Any]) -> None:
        self.obj = obj
        self.schema = schema
        self.name = tool_name(schema)

    def create(self, instance_id: str, **kwargs: Any) -> Any:
        created = resolve(self.obj.create(instance_id, **kwargs))
        # verl's create returns the instance id, or (instance id, ToolResponse).
        if isinstance(created, tuple) and created and isinstance(created[0], str):
            return created[0]
        return created if isinstance(created, str) else instance_id

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        return coerce_result(resolve(self.obj.execute(instance_id, arguments)))

    def release(self, instance_id: str) -> None:
        resolve(self.obj.release(instance_id))

    def __repr__(self) -> str:
        return f"{type(self.obj).__name__}({self.name!r})"


def as_tool(obj: Any) -> Tool:
    """``obj`` as a :class:`Tool`: itself if it is a :class:`BaseTool` or another synchronous tool
    with a ``schema`` dict, else wrapped (verl-style objects). Raises TypeError naming what is missing."""
    missing = [m for m in ("create", "execute", "release") if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"{type(obj).__name__} is not a tool: it has no {', '.join(missing)} method")
    schema = getattr(obj, "schema", None)
    if isinstance(schema, dict) and not _is_async(obj):
        return obj
    if schema is None or not isinstance(schema, dict):
        schema = getattr(obj, "tool_schema", None)
    if schema is None:
        raise TypeError(f"{type(obj).__name__} is not a tool: it has no schema (or tool_schema)")
    return _AdaptedTool(obj, plain_schema(schema))


def _is_async(obj: Any) -> bool:
    return any(inspect.iscoroutinefunction(getattr(obj, m)) for m in ("create", "execute", "release"))
