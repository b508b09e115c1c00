"""What answers a multi-turn rollout's assistant turns: the seam between the agent loop and the turns' source.

The agent loop (:mod:`spmdrl.rollout.agent_loop`) samples an assistant turn with the engine, hands its text
to a :class:`TurnEnv`, and appends what the env answers as ids of loss mask 0 (rendered by the chat
template, :class:`~spmdrl.data.turns.TurnCodec`), or ends the trajectory where the env says so. Two envs:

- :class:`ToolTurnEnv`: spmdrl's tools (``rollout.multi_turn.tools``): the turn's tool calls run, their
  results are the answer; a turn without a call ends the trajectory.
- :class:`spmdrl.rollout.vf_turns.VfTurnEnv`: a verifiers 0.3.x ``MultiTurnEnv`` (``env.source``), which
  decides itself when the conversation is over and what the user or its tools say next.

An env is called only on the deciding rank of each engine (a TP group's first), from worker threads, one
call at a time per trajectory; its sessions are its own objects, opened on a trajectory's first turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from spmdrl.tools.executor import ToolCallOutcome, ToolExecutor
from spmdrl.tools.parser import Parser


@dataclass
class TurnReply:
    """An env's answer to an assistant turn."""

    # Messages ({"role": "tool" | "user", "content": ...}) that follow the turn; the next turn is sampled
    # after them. A content is a string, or a list of parts with images for a vision-language model
    # ({"type": "image", "image": <PIL>}, {"type": "text", "text": ...}: spmdrl.data.turns.Observation). With ``end`` set they are the conversation's last words (kept for the reward, not sampled
    # after: verifiers' final_env_response).
    messages: list[dict[str, Any]] = field(default_factory=list)
    # Why the trajectory ends now (a terminate reason: "stop", "env_error", ...); "" to continue.
    end: str = ""
    # What the turn did, added to the trajectory's TrajectoryInfo (tool_calls, tool_errors, ...).
    counts: dict[str, Any] = field(default_factory=dict)


class TurnEnv(Protocol):
    """The source of a multi-turn rollout's non-sampled turns."""

    def open(self, context: Mapping[str, Any]) -> Any:
        """A trajectory's session, from its prompt's ``extra_info`` (``context``)."""
        ...

    def reply(self, session: Any, text: str) -> TurnReply:
        """The answer to the assistant turn ``text`` (decoded from the engine's ids)."""
        ...

    def finish(self, session: Any, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Ends the session; what the trajectory adds to its reward's ``extra_info``. ``messages``: the
        conversation after the prompt, as the loop kept it (every assistant turn and answer)."""
        ...


class ToolImageError(ValueError):
    """A tool returned an image for a model that takes none (a text model)."""


def tool_image_message(tool: str, images: int | None, model: str = "the model") -> str:
    """Why a tool's images cannot reach a text model, and what to do (at start for a tool that says it
    returns images, ``returns_images``, ``images`` None; during the rollout for any other)."""
    did = "returns images" if images is None else f"returned {images} image(s)"
    return (
        f"tool {tool!r} {did}, but {model} is a text model: only a vision-language "
        "model reads images in a tool message (docs/tools.md#image-observations). Use a vision-language "
        f"model (model.path=tiny-vl, a SmolVLM / Idefics3 checkpoint), or make tool {tool!r} return text "
        "only (an empty ToolResult.image), or remove it from rollout.multi_turn.tools"
    )


class ToolTurnEnv:
    """spmdrl's tools as a TurnEnv: the turn's ``<tool_call>`` blocks (``parser``) run on ``executor``.
    ``images``: whether the model takes images; without, a tool that returns one stops the rollout
    (:class:`ToolImageError`, naming the tool) rather than the model never seeing what it asked for."""

    def __init__(self, executor: ToolExecutor, parser: Parser, *, images: bool = False) -> None:
        self.executor = executor
        self.parser = parser
        self.images = images

    def open(self, context: Mapping[str, Any]) -> Any:
        # verl's extra_info.tools_kwargs ({tool: {"create_kwargs": {...}}}), if the row has one.
        kwargs = context.get("tools_kwargs")
        return self.executor.open_session(kwargs if isinstance(kwargs, dict) else None)

    def reply(self, session: Any, text: str) -> TurnReply:
        parsed = self.parser(text)
        if not parsed.calls and not parsed.errors:
            return TurnReply(end="stop")
        outcomes = self.executor.run(parsed.calls, session=session) if parsed.calls else []
        outcomes += [ToolCallOutcome.parse_error(e) for e in parsed.errors]
        counts = {
            "tool_calls": len(parsed.calls) + len(parsed.errors),
            "tool_errors": sum(o.status in ("error", "invalid") for o in outcomes),
            "parse_errors": sum(o.status == "parse_error" for o in outcomes),
            "timeouts": sum(o.status == "timeout" for o in outcomes),
            "tool_reward": sum(o.reward for o in outcomes),
            "latencies": [o.latency_s for o in outcomes if o.status in ("ok", "error", "timeout")],
        }
        if not self.images:
            for o in outcomes:
                if o.images:
                    raise ToolImageError(tool_image_message(o.name, len(o.images)))
        return TurnReply([o.message() for o in outcomes], counts=counts)

    def finish(self, session: Any, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        self.executor.close_session(session)
        return {}
