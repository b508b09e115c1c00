"""A verifiers 0.3.x ``MultiTurnEnv`` driven turn by turn in spmdrl's agent loop (a TurnEnv).

verifiers runs a multi-turn rollout itself (``MultiTurnEnv.rollout``: ask a client for the model's reply,
ask the env for the next messages, until a stop condition fires). Here spmdrl's engine samples the replies
(token ids and logprobs kept as sampled), so the env's own steps are called in rollout's order instead, on
a state made as rollout makes it: ``init_state`` (with an in-process client object that never serves a
request: the engine answers) and ``setup_state`` when a trajectory opens; after each assistant turn
``add_trajectory_step``, ``is_completed`` (its stop conditions) and ``get_prompt_messages`` (which calls
``env_response``); ``cleanup`` at the end. No HTTP server and no model client are involved.

What ends a trajectory here (the loop's other ends, length, max_turns and the deadline, stay as they are):

- a stop condition: ``stop`` (``max_turns`` for the env's own max_turns; ``env_error`` for its has_error);
- ``env_error``: a call raised (its cause logged once per env);
- ``env_timeout``: a call did not return within ``call_timeout_s`` (it is abandoned in its thread);
- ``env_rewrite``: the env's next prompt does not continue the conversation so far (it rewrote or dropped
  earlier messages), so the trajectory's ids could not be a prefix of the next turn's prompt.

The conversation after the prompt (as the model saw it) and the JSON-safe part of the state go to the
reward's extra_info (``env_completion``, ``env_state``: spmdrl.envs.reward scores them with the rubric).

A ``ToolEnv`` (an env with ``tool_defs``): the prompts describe its tools to the model through the chat
template (:func:`tool_schemas`), and an assistant turn's ``<tool_call>`` blocks (hermes format) become the
message's ``tool_calls``, which its ``env_response`` runs and its ``no_tools_called`` stop reads.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from spmdrl.envs.config import EnvConfig
from spmdrl.envs.load import LoadedEnv
from spmdrl.envs.reward import COMPLETION_KEY, STATE_KEY
from spmdrl.envs.rows import TASK_KEY
from spmdrl.envs.setup import load_env
from spmdrl.errors import ConfigError
from spmdrl.rollout.config import MultiTurnConfig
from spmdrl.rollout.turn_env import TurnReply
from spmdrl.tools.parser import get_parser

log = logging.getLogger(__name__)
T = TypeVar("T")

# verifiers' own state entries, rebuilt by the reward from the task and the completion (or not JSON).
_STATE_OWN = {
    "input", "task", "prompt", "completion", "trajectory", "client", "model", "sampling_args", "timing",
    "tool_defs", "usage", "usage_tracker", "trajectory_id", "reward", "metrics", "error", "is_completed",
    "is_truncated", "final_env_response",
}  # fmt: skip
# The model verifiers' state records (the engine is not a named model).
MODEL = "spmdrl-engine"


class EnvCallTimeout(Exception):
    pass


@dataclass
class _Session:
    state: Any = None
    sent: list[Any] | None = None  # the conversation the last turn was sampled after (verifiers messages)
    end: str = ""  # why the conversation ended (it could not open, or a reply ended it); "" while it goes on


class VfTurnEnv:
    """The turns of a loaded 0.3.x multi-turn environment (``LoadedEnv.multi_turn``)."""

    def __init__(self, loaded: LoadedEnv, *, call_timeout_s: float) -> None:
        self.env = loaded.env
        self.source = loaded.source
        self.call_timeout_s = call_timeout_s
        self._vf = importlib.import_module("verifiers.legacy")
        self._client = _engine_client(self._vf)
        self._logged = False
        # An env with tools reads the turn's calls from the message (ToolEnv's env_response).
        self._parse = get_parser("hermes") if tool_schemas(loaded) else None

    def open(self, context: Mapping[str, Any]) -> _Session:
        row = json.loads(context[TASK_KEY])
        session = _Session()

        async def start() -> None:
            state = await self.env.init_state(row, self._client, MODEL)
            session.state = (await self.env.setup_state(state)) or state
            session.sent = list(session.state["prompt"])

        _, session.end = self._guarded(lambda: self._call(start))  # a failure ends it at the first reply
        return session

    def reply(self, session: _Session, text: str) -> TurnReply:
        if session.end:
            return TurnReply(end=session.end)
        answer, failed = self._guarded(lambda: self._turn(session, text))
        if answer is None:
            answer = TurnReply(end=failed)
        session.end = answer.end  # an ended conversation stays ended (the loop asks no more)
        return answer

    def _turn(self, session: _Session, text: str) -> TurnReply:
        env, state = self.env, session.state
        assert session.sent is not None
        said = self._assistant(text)
        step = {
            "prompt": session.sent,
            "completion": [said],
            "response": None,  # no client response: the engine sampled the turn
            "tokens": None,
            "reward": None,
            "advantage": None,
            "is_truncated": False,
            "trajectory_id": state["trajectory_id"],
            "extras": {},
        }

        async def turn() -> Any:
            await env.add_trajectory_step(state, step)
            if await env.is_completed(state):
                return None
            return await env.get_prompt_messages(state)

        prompt = self._call(turn)
        if prompt is None:
            return TurnReply(end=_stop_reason(state.get("stop_condition")))
        so_far = [*session.sent, said]
        if [_plain(m) for m in prompt[: len(so_far)]] != [_plain(m) for m in so_far]:
            self._log_once("its next prompt does not continue the conversation (ended env_rewrite)")
            return TurnReply(end="env_rewrite")
        session.sent = list(prompt)
        new = [_message(m) for m in prompt[len(so_far) :]]
        # env_response's final_env_response: its last words, after which no turn is sampled.
        return TurnReply(new, end="stop" if state.get("final_env_response") is not None else "")

    def finish(self, session: _Session, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The conversation for the rubric, and the env's state; never raises (cleanup's errors are logged)."""
        if session.state is None:
            return {}
        state = session.state
        self._guarded(lambda: self._call(lambda: self.env.cleanup(state)))
        completion = [
            self._assistant(m["content"]).model_dump(exclude_none=True)
            if m["role"] == "assistant"
            else dict(m)
            for m in messages
        ]
        return {COMPLETION_KEY: completion, STATE_KEY: _json_safe(state)}

    def _assistant(self, text: str) -> Any:
        """The turn as verifiers' message: its text, and the tool calls written in it (an env with tools)."""
        calls = self._parse(text).calls if self._parse is not None else []
        tool_calls = [
            self._vf.ToolCall(id=f"call_{i}", name=c.name, arguments=json.dumps(c.arguments))
            for i, c in enumerate(calls)
        ]
        return self._vf.AssistantMessage(content=text, tool_calls=tool_calls or None)

    def _guarded(self, fn: Callable[[], T]) -> tuple[T | None, str]:
        """(``fn()``, "") or, when it hung or raised, (None, "env_timeout" / "env_error")."""
        try:
            return fn(), ""
        except EnvCallTimeout:
            self._log_once(f"a call took over {self.call_timeout_s:g} s (rollout.multi_turn.tool_timeout_s)")
            return None, "env_timeout"
        except Exception as e:
            self._log_once(f"a call raised {type(e).__name__}: {e}", exc=e)
            return None, "env_error"

    def _call(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """``make()``'s coroutine run to its end on an event loop of its own, in a thread of its own, so a
        call that blocks or hangs is abandoned after call_timeout_s without holding up the other
        trajectories (verifiers' env methods are async; nothing else runs an event loop here)."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = asyncio.run(make())
            except BaseException as e:  # handed to the caller
                box["error"] = e

        thread = threading.Thread(target=target, name="vf-env", daemon=True)
        thread.start()
        thread.join(self.call_timeout_s)
        if thread.is_alive():
            raise EnvCallTimeout
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _log_once(self, what: str, exc: BaseException | None = None) -> None:
        if not self._logged:
            self._logged = True
            log.warning("env.source=%s: %s (the first failure only; multi_turn/terminate_reason/env_* count "
                        "the trajectories ended so)", self.source, what, exc_info=exc)  # fmt: skip


def _stop_reason(condition: Any) -> str:
    return {"has_error": "env_error", "max_turns_reached": "max_turns"}.get(str(condition), "stop")


def _plain(message: Any) -> dict[str, Any]:
    """A verifiers message as the chat template renders it: role and text."""
    from spmdrl.envs.legacy import _text

    role = message["role"] if isinstance(message, dict) else message.role
    content = message.get("content") if isinstance(message, dict) else message.content
    return {"role": str(role), "content": _text(content)}


def _message(message: Any) -> dict[str, Any]:
    """An env message for the chat template and the rubric: role, text, and a tool message's call id."""
    out = _plain(message)
    call_id = message.get("tool_call_id")
    if call_id is not None:
        out["tool_call_id"] = str(call_id)
    return out


def tool_schemas(loaded: LoadedEnv) -> list[dict[str, Any]] | None:
    """The environment's tools (a ToolEnv's ``tool_defs``) as the chat template's function schemas; None
    when it has none."""
    defs = getattr(loaded.env, "tool_defs", None) or []
    return [
        {
            "type": "function",
            "function": {"name": d.name, "description": d.description, "parameters": d.parameters},
        }
        for d in defs
    ] or None


def _json_safe(state: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dict(state).items():
        if key in _STATE_OWN:
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def _engine_client(vf: Any) -> Any:
    """A verifiers Client that the state holds (init_state needs one) and that serves nothing: spmdrl's
    engine samples every assistant turn, so a call to it is a bug of this module."""
    from verifiers.legacy.clients import Client

    class EngineClient(Client):  # type: ignore[misc]
        def setup_client(self, config: Any) -> Any:
            return None

        async def _refuse(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                "spmdrl's engine samples the replies; the environment asked its client for one"
            )

        to_native_tool = to_native_prompt = get_native_response = _refuse
        raise_from_native_response = from_native_response = _refuse

        async def close(self) -> None:
            return None

    return EngineClient(None)


def check_env_turns(cfg: EnvConfig, mt: MultiTurnConfig, collective_timeout_min: float) -> str:
    """A multi-turn environment's turns fit the rollout.multi_turn settings that bound them (the agent loop
    drives them: spmdrl.rollout.vf_turns); returns a few words for ``--check``'s line."""
    if not load_env(cfg).multi_turn:
        return "single-turn"
    if mt.enable:
        raise ConfigError(
            f"env.source={cfg.source} is a multi-turn environment that gives its own turns, and "
            "rollout.multi_turn.enable=true would add spmdrl's tools beside them; set "
            "rollout.multi_turn.enable=false (the rollout.multi_turn limits still bound the environment's turns)"
        )
    if mt.max_assistant_turns <= 0 or mt.max_user_turns < 0 or mt.tool_timeout_s <= 0:
        raise ConfigError(
            "env.source's turns are bounded by rollout.multi_turn.max_assistant_turns (> 0), max_user_turns "
            f"(>= 0) and tool_timeout_s (> 0, each environment call); got {mt.max_assistant_turns}, "
            f"{mt.max_user_turns}, {mt.tool_timeout_s}"
        )
    limit_s = collective_timeout_min * 60
    if mt.rollout_deadline_s >= limit_s or mt.tool_timeout_s >= limit_s:
        # As for spmdrl's tools (spmdrl.config): a rank still driving an environment must not be what ends
        # the others' wait in the next collective, unnamed.
        raise ConfigError(
            f"rollout.multi_turn.rollout_deadline_s={mt.rollout_deadline_s} and tool_timeout_s={mt.tool_timeout_s} "
            f"bound env.source={cfg.source}'s turns and must stay below trainer.collective_timeout_min="
            f"{collective_timeout_min:g} minutes: the other ranks wait in the next collective while a rank "
            "finishes its rollout"
        )
    return f"multi-turn: up to {mt.max_assistant_turns} assistant turns, {mt.tool_timeout_s:g} s per environment call"
