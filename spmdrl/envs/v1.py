"""verifiers 0.4 (``verifiers.v1``) tasksets: building one from env.args, its tasks as rows, and scoring a
reply with the task's ``@vf.reward`` / ``@vf.metric`` methods.

A task is scored offline, as verifiers scores one without a runtime: ``Task.score(trace)`` on a Trace
holding the prompt and the policy's reply (rewards that need a runtime (a sandbox) are skipped by
verifiers and logged). Its total is the weighted sum of the rewards (``Trace.reward``); each reward's
unweighted score and each metric are the extras (``reward/extra/<name>``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from spmdrl.errors import ConfigError


def build_taskset(source: str, cls: type, args: dict[str, Any]) -> Any:
    """``cls`` configured by its TasksetConfig with the fields ``args`` (env.args)."""
    from verifiers.v1 import Taskset, TasksetConfig
    from verifiers.v1.utils.generic import concrete_type

    config_type = concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig
    try:
        config = config_type.model_validate({**args, "id": cls.__module__.split(".")[0]})
    except ValueError as e:  # pydantic's ValidationError
        raise ConfigError(
            f"env.source={source}: env.args do not fit {config_type.__name__} (the fields of "
            f"{cls.__name__}'s config): {e}"
        ) from None
    try:
        return cls(config)
    except Exception as e:
        raise ConfigError(
            f"env.source={source}: {cls.__name__}(config) raised {type(e).__name__}: {e}"
        ) from e


def is_multi_turn(taskset: Any, env_cls: type | None) -> bool:
    """An exported Env subclass, or tools (the taskset's or its tasks'), mean turns after the first reply."""
    task_type = taskset.task_type()
    return (
        env_cls is not None
        or bool(type(taskset).toolsets(taskset.config))
        or bool(task_type.toolsets(taskset.config.task))
    )


def iter_tasks(taskset: Any) -> Iterator[Any]:
    if not taskset.bounded:
        raise ConfigError(f"the taskset {type(taskset).__name__} is infinite; set env.num_train to bound it")
    return iter(taskset)


def prompt_messages(data: Any) -> list[dict[str, Any]]:
    """The task's opening messages: its system prompt, then its prompt (a string or messages)."""
    from verifiers.v1.types import content_text

    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt or []:
            messages.append({"role": m.role, "content": content_text(m.content)})
    return messages


def task_row(task: Any) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """(prompt messages, ground truth text, the payload that rebuilds the task in a reward worker)."""
    data = task.data
    answer = getattr(data, "answer", None)
    return prompt_messages(data), "" if answer is None else str(answer), data.model_dump(mode="json")


def score(taskset: Any, payload: dict[str, Any], completion: list[dict[str, Any]]) -> dict[str, float]:
    """``{"score": total, <reward>: score, <metric>: value}`` of the task ``payload`` answered by
    ``completion`` (the reply's messages). Raises what a reward method raised."""
    from verifiers.v1 import AgentConfig, AssistantMessage, SystemMessage, ToolMessage, Trace, UserMessage
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    by_role = {
        "system": SystemMessage,
        "user": UserMessage,
        "assistant": AssistantMessage,
        "tool": ToolMessage,
    }

    task_cls = taskset.task_type()
    data = task_cls.data_type().model_validate(payload)
    task = task_cls(data, taskset.config.task)
    messages = [*prompt_messages(data), *completion]
    nodes = [
        MessageNode(
            parent=i - 1 if i else None,
            message=by_role[m["role"]].model_validate(m),
            sampled=i >= len(messages) - len(completion) and m["role"] == "assistant",
        )
        for i, m in enumerate(messages)
    ]
    trace = Trace(
        task=TraceTask(type=task_cls.__name__, data=data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=AgentConfig()),
        nodes=nodes,
        is_completed=True,
        ok=True,
    )
    asyncio.run(task.score(trace))
    unscored = sorted(name for name, r in trace.rewards.items() if r is None)
    if unscored:
        raise RuntimeError(f"task {task_cls.__name__}: rewards {unscored} were not scored")
    out: dict[str, float] = {"score": trace.reward}
    out.update({name: r.score for name, r in trace.rewards.items() if r is not None})
    out.update({name: float(v) for name, v in trace.metrics.items() if v is not None})
    return out
