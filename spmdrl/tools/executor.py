"""Running a batch of tool calls: at most ``max_parallel_calls`` at once, each within
``tool_timeout_s``, and never an exception into the rollout.

Every call gets a :class:`ToolCallOutcome`, whose ``text`` is what the model reads next:

=============== ============================================================ ==========================
status          when                                                         text
=============== ============================================================ ==========================
``ok``          the tool returned                                            its result
``error``       the tool raised (``ToolError``: an expected failure; any      ``Error: <message>``
                other exception is logged with its traceback)
``timeout``     create + execute + release took longer than tool_timeout_s   ``Error: tool 'x' timed
                                                                             out after 2 s``
``invalid``     an unknown tool, or arguments that do not fit its schema      ``Error: ...`` (what is
                                                                             wrong)
``parse_error`` the model's call could not be read (from the parser)          ``Error: <parse error>``
=============== ============================================================ ==========================

Why threads, one per call: the built-in python tool's work is in a child process, and a tool that
waits on a process or a socket releases the GIL, so threads overlap them well; the calculator is
microseconds. A thread cannot be stopped, though: at the timeout the executor stops waiting for the
call (the model gets the timeout text and the call's slot goes to the next call), but the thread runs
on until the tool returns. The python tool enforces its own wall-time limit (keep its ``timeout_s``
below ``tool_timeout_s``); an in-process tool (a function, the calculator) must bound its own work.
Abandoned threads are counted (``abandoned_threads``) and logged.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from spmdrl.tools.base import Tool, ToolError, as_tool, coerce_result, resolve, tool_name
from spmdrl.tools.parser import ToolCall
from spmdrl.tools.schema import validate_arguments

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout", "invalid", "parse_error"]
STATUSES: tuple[Status, ...] = ("ok", "error", "timeout", "invalid", "parse_error")
# Of a call's argument errors, this many are named in its text.
_MAX_ARG_ERRORS = 5


@dataclass
class ToolCallOutcome:
    name: str  # the tool called; "" for a parse error
    status: Status
    text: str  # the content of the tool message the model reads
    latency_s: float = 0.0  # from the call's start to its result (tool_timeout_s for a timeout)
    reward: float = 0.0  # the tool's step reward (0 unless ok)
    metrics: dict[str, float] = field(default_factory=dict)  # the tool's own, when ok
    detail: str = ""  # for logs, not the model: a traceback
    images: list[Any] = field(default_factory=list)  # the tool's images (ToolResult.image), when ok

    @classmethod
    def parse_error(cls, message: str) -> ToolCallOutcome:
        """The outcome for one of :attr:`ParseResult.errors`, for counting and, if the rollout sends
        parse errors back, for the model to read."""
        return cls(name="", status="parse_error", text=f"Error: {message}")

    def message(self) -> dict[str, Any]:
        """The chat message carrying the result (Qwen's template renders it in <tool_response>); with
        images, its content is a list of parts, each image (``{"type": "image", "image": <PIL>}``) before
        the text, as verl's tool agent loop writes a tool response with images."""
        if not self.images:
            return {"role": "tool", "content": self.text}
        parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in self.images]
        return {"role": "tool", "content": [*parts, {"type": "text", "text": self.text}]}


class ToolSession:
    """One trajectory's tool instances: each tool is created at the trajectory's first call of it (with
    the row's ``create_kwargs``) and released by :meth:`ToolExecutor.close_session` when the trajectory
    ends, so a stateful tool (a sandbox, a game) keeps its state across the turns, as verl's do."""

    def __init__(self, tools_kwargs: Mapping[str, Any] | None) -> None:
        self.tools_kwargs = tools_kwargs
        self.instances: dict[str, str] = {}  # tool name -> instance id
        self.lock = threading.Lock()


class ToolExecutor:
    """Runs tool calls for one rank. Thread-safe; one executor serves every trajectory of the rank."""

    def __init__(
        self,
        tools: Mapping[str, Any] | Sequence[Any],
        *,
        max_parallel_calls: int = 8,
        tool_timeout_s: float = 30.0,
    ) -> None:
        if max_parallel_calls < 1:
            raise ValueError(f"max_parallel_calls must be >= 1, got {max_parallel_calls}")
        if not tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        listed = list(tools.values()) if isinstance(tools, Mapping) else list(tools)
        adapted = [as_tool(t) for t in listed]
        self.tools: dict[str, Tool] = {tool_name(t.schema): t for t in adapted}
        if len(self.tools) != len(adapted):
            raise ValueError("two tools share a name")
        self.max_parallel_calls = max_parallel_calls
        self.tool_timeout_s = tool_timeout_s
        self._abandoned: set[threading.Thread] = set()
        self._lock = threading.Lock()

    @property
    def abandoned_threads(self) -> int:
        """Threads of timed-out calls still running their tool."""
        with self._lock:
            self._abandoned = {t for t in self._abandoned if t.is_alive()}
            return len(self._abandoned)

    def open_session(self, tools_kwargs: Mapping[str, Any] | None = None) -> ToolSession:
        return ToolSession(tools_kwargs)

    def close_session(self, session: ToolSession) -> None:
        """Release the session's tool instances (a release that raises is logged, never raised)."""
        with session.lock:
            instances, session.instances = session.instances, {}
        for name, instance_id in instances.items():
            try:
                resolve(self.tools[name].release(instance_id))
            except Exception:  # noqa: BLE001 - the trajectory is over; a leaking tool is logged
                log.warning("tool %r: release(%s) raised:\n%s", name, instance_id, traceback.format_exc())

    def run(
        self,
        calls: Sequence[ToolCall],
        tools_kwargs: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        session: ToolSession | None = None,
    ) -> list[ToolCallOutcome]:
        """One outcome per call, in order. ``tools_kwargs[i]``: call i's data row ``tools_kwargs``
        (verl: ``{tool name: {"create_kwargs": {...}}}``), whose ``create_kwargs`` for the tool go to
        its ``create``. With a ``session`` (one trajectory), instances live in it across calls and its
        ``tools_kwargs`` apply; without one, each call creates and releases its own instance. Blocks
        until every call is done or timed out; never raises."""
        if session is not None:
            tools_kwargs = [session.tools_kwargs] * len(calls)
        if tools_kwargs is not None and len(tools_kwargs) != len(calls):
            raise ValueError(f"{len(tools_kwargs)} tools_kwargs for {len(calls)} calls")
        outcomes: list[ToolCallOutcome | None] = [None] * len(calls)
        pending: deque[int] = deque()
        for i, call in enumerate(calls):
            outcomes[i] = self._check(call)
            if outcomes[i] is None:
                pending.append(i)
        done: queue.SimpleQueue[tuple[int, ToolCallOutcome]] = queue.SimpleQueue()
        running: dict[int, tuple[float, threading.Thread]] = {}  # index -> (start, thread)
        while pending or running:
            while pending and len(running) < self.max_parallel_calls:
                i = pending.popleft()
                row = tools_kwargs[i] if tools_kwargs is not None else None
                thread = threading.Thread(
                    target=self._call,
                    args=(i, calls[i], _create_kwargs(row, calls[i].name), done, session),
                    name=f"tool-{calls[i].name}",
                    daemon=True,
                )
                try:
                    thread.start()
                except RuntimeError as e:  # "can't start new thread": out of threads or memory
                    outcomes[i] = ToolCallOutcome(
                        calls[i].name, "error", f"Error: tool {calls[i].name!r} could not start: {e}"
                    )
                    continue
                running[i] = (time.monotonic(), thread)
            if not running:
                continue
            wake = min(start for start, _ in running.values()) + self.tool_timeout_s
            try:
                i, outcome = done.get(timeout=max(0.0, wake - time.monotonic()))
                if i in running:  # not already timed out
                    del running[i]
                    outcomes[i] = outcome
            except queue.Empty:
                pass
            now = time.monotonic()
            for i, (start, thread) in list(running.items()):
                if now - start >= self.tool_timeout_s:
                    del running[i]
                    outcomes[i] = self._timed_out(calls[i].name, thread)
        self._log_failures(outcomes)  # type: ignore[arg-type]
        return outcomes  # type: ignore[return-value]

    def _check(self, call: ToolCall) -> ToolCallOutcome | None:
        """The outcome of a call that cannot run (unknown tool, bad arguments); None if it can."""
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolCallOutcome(
                call.name,
                "invalid",
                f"Error: unknown tool {call.name!r}; the tools are: {', '.join(self.tools)}",
            )
        try:
            errors = validate_arguments(tool.schema, call.arguments)
        except Exception as e:  # a schema the check does not understand: let the tool judge
            log.warning("tool %r: checking arguments raised %s: %s", call.name, type(e).__name__, e)
            errors = []
        if errors:
            shown = "; ".join(errors[:_MAX_ARG_ERRORS]) + (
                f"; and {len(errors) - _MAX_ARG_ERRORS} more" if len(errors) > _MAX_ARG_ERRORS else ""
            )
            return ToolCallOutcome(
                call.name, "invalid", f"Error: invalid arguments for tool {call.name!r}: {shown}"
            )
        return None

    def _call(
        self,
        index: int,
        call: ToolCall,
        create_kwargs: Mapping[str, Any],
        done: queue.SimpleQueue[tuple[int, ToolCallOutcome]],
        session: ToolSession | None = None,
    ) -> None:
        """A call's thread: create, execute, release (create once per session, release at its close);
        reports exactly one outcome."""
        tool = self.tools[call.name]
        start = time.monotonic()
        instance_id = uuid.uuid4().hex
        created = False
        try:
            if session is not None:
                instance_id = self._session_instance(session, call.name, create_kwargs)
            else:
                created_id = resolve(tool.create(instance_id, create_kwargs=create_kwargs))
                created = True
                if isinstance(created_id, str) and created_id:
                    instance_id = created_id
            result = coerce_result(resolve(tool.execute(instance_id, dict(call.arguments))))
            outcome = ToolCallOutcome(
                call.name,
                "ok",
                result.text,
                reward=result.reward,
                metrics=result.metrics,
                images=result.image,
            )
        except ToolError as e:
            outcome = ToolCallOutcome(call.name, "error", f"Error: {e}")
        except BaseException as e:  # noqa: BLE001 - SystemExit from a tool is a failed call too
            outcome = ToolCallOutcome(
                call.name,
                "error",
                f"Error: tool {call.name!r} raised {type(e).__name__}: {e}",
                detail=traceback.format_exc(),
            )
        finally:
            if created:
                try:
                    resolve(tool.release(instance_id))
                except Exception:  # noqa: BLE001 - the result stands; a leaking tool is logged
                    log.warning(
                        "tool %r: release(%s) raised:\n%s", call.name, instance_id, traceback.format_exc()
                    )
        outcome.latency_s = time.monotonic() - start
        done.put((index, outcome))

    def _session_instance(self, session: ToolSession, name: str, create_kwargs: Mapping[str, Any]) -> str:
        # Under the session's lock: two calls of one tool in one turn share one instance.
        with session.lock:
            if name not in session.instances:
                instance_id = uuid.uuid4().hex
                created_id = resolve(self.tools[name].create(instance_id, create_kwargs=create_kwargs))
                session.instances[name] = (
                    created_id if isinstance(created_id, str) and created_id else instance_id
                )
            return session.instances[name]

    def _timed_out(self, name: str, thread: threading.Thread) -> ToolCallOutcome:
        with self._lock:
            self._abandoned.add(thread)
        return ToolCallOutcome(
            name,
            "timeout",
            f"Error: tool {name!r} timed out after {self.tool_timeout_s:g} s",
            self.tool_timeout_s,
        )

    def _log_failures(self, outcomes: Sequence[ToolCallOutcome]) -> None:
        """A batch's timeouts, and its first raised exception with its traceback (the rest are counted)."""
        timed_out = sorted({o.name for o in outcomes if o.status == "timeout"})
        if timed_out:
            log.warning(
                "%d of %d tool calls (tools %s) timed out after %g s; their threads run on until the "
                "tools return (%d such threads alive)",
                sum(o.status == "timeout" for o in outcomes),
                len(outcomes),
                ", ".join(timed_out),
                self.tool_timeout_s,
                self.abandoned_threads,
            )
        raised = [o for o in outcomes if o.detail]
        if raised:
            log.warning(
                "%d of %d tool calls raised; the first (tool %r):\n%s",
                len(raised),
                len(outcomes),
                raised[0].name,
                raised[0].detail,
            )


def _create_kwargs(row: Any, name: str) -> dict[str, Any]:
    """``row[name]["create_kwargs"]``, or {} where the data has no such mapping (Arrow fills the
    tools a row does not mention with None)."""
    entry = row.get(name) if isinstance(row, Mapping) else None
    kwargs = entry.get("create_kwargs") if isinstance(entry, Mapping) else None
    return dict(kwargs) if isinstance(kwargs, Mapping) else {}


def summarize(outcomes: Sequence[ToolCallOutcome], prefix: str = "tools/") -> dict[str, float]:
    """Counts per status, latency statistics, and each tool's metrics averaged over its ok calls, for
    the step's metrics. Counts add across ranks; means need the counts to be weighted."""
    stats: dict[str, float] = {f"{prefix}calls": float(len(outcomes))}
    for status in STATUSES:
        stats[f"{prefix}{status}"] = float(sum(o.status == status for o in outcomes))
    timed = [o.latency_s for o in outcomes if o.status in ("ok", "error", "timeout")]  # ones that ran
    if timed:
        stats[f"{prefix}latency_mean_s"] = sum(timed) / len(timed)
        stats[f"{prefix}latency_max_s"] = max(timed)
    per_tool: dict[str, list[dict[str, float]]] = {}
    for o in outcomes:
        if o.status == "ok":
            per_tool.setdefault(o.name, []).append(o.metrics)
    for name, metrics in per_tool.items():
        for key in sorted({k for m in metrics for k in m}):
            values = [m[key] for m in metrics if key in m]
            stats[f"{prefix}{name}/{key}"] = sum(values) / len(values)
    return stats


Side = Literal["left", "right", "middle"]


def truncate_tokens(
    text_ids: Sequence[int], max_len: int, side: Side = "middle", marker: Sequence[int] = ()
) -> list[int]:
    """``text_ids`` cut to at most ``max_len`` tokens, ``marker`` (say the ids of "...(truncated)...")
    included, as verl's ``tool_response_truncate_side`` names the sides: ``left`` keeps the start,
    ``right`` keeps the end, ``middle`` keeps both ends and drops the middle."""
    ids = list(text_ids)
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    if side not in ("left", "right", "middle"):
        raise ValueError(f"side must be 'left', 'right' or 'middle', got {side!r}")
    if len(ids) <= max_len:
        return ids
    mark = list(marker)
    if len(mark) >= max_len:
        mark = []  # no room for the marker: the tokens themselves matter more
    keep = max_len - len(mark)
    if side == "left":
        return ids[:keep] + mark
    if side == "right":
        return mark + ids[len(ids) - keep :]
    head = (keep + 1) // 2
    tail = keep - head
    return ids[:head] + mark + (ids[len(ids) - tail :] if tail else [])


def truncate_text(text: str, max_chars: int, side: Side = "middle") -> str:
    """verl's own cut of a tool response, in characters and with its markers (the markers are added
    beyond ``max_chars``, as verl does)."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_chars:]
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")
