"""verifiers 0.3.x ("legacy": ``import verifiers as vf``) environments: their datasets as rows, and a
reply scored with their Rubric's reward functions.

A rubric function is called the way ``Rubric`` calls it (the same objects: prompt, completion, answer,
state, info, task, parser and the rubric's class objects, each function given those it names), but not
through ``Rubric.score_rollout``: that catches a function's exception and scores it 0.0, and spmdrl counts
a function that raises as a failed sample (reward/errors, bounded by reward.max_error_frac). Functions of
weight 0 are verifiers' metrics: logged, adding nothing. Group-level reward functions (``completions``,
``states``, ... : a whole group's rollouts at once) cannot score one sample and are refused at start.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import json
from typing import Any

from spmdrl.errors import ConfigError


def reward_funcs(rubric: Any) -> list[tuple[Any, Any, float]]:
    """(rubric, function, weight) of every reward function, through RubricGroups."""
    inner = getattr(rubric, "rubrics", None)
    if inner is not None:
        return [entry for r in inner for entry in reward_funcs(r)]
    return list(zip([rubric] * len(rubric.funcs), rubric.funcs, rubric.weights, strict=True))


def check_rubric(source: str, env: Any) -> None:
    """A rubric spmdrl can score sample by sample: some function, none group-level."""
    funcs = reward_funcs(env.rubric)
    group = [f.__name__ for rubric, f, _ in funcs if rubric._is_group_func(f)]
    if group:
        raise ConfigError(
            f"env.source={source}: the rubric's group-level reward functions ({', '.join(group)}) score a "
            "whole group of rollouts at once; spmdrl scores each sample alone (its advantages are then "
            "taken over the group), so rewrite them to score one rollout"
        )
    if not any(w for _, _, w in funcs):
        raise ConfigError(
            f"env.source={source}: the rubric has no reward function of non-zero weight, so every sample "
            "would score 0"
        )


def has_eval_dataset(env: Any) -> bool:
    return env.build_eval_dataset() is not None


def dataset_rows(env: Any, split: str, n: int) -> list[dict[str, Any]]:
    """The first ``n`` rows (0: all) of the environment's dataset (``split`` "train") or eval dataset."""
    ds = env.get_dataset(n if n > 0 else -1) if split == "train" else env.get_eval_dataset(n if n > 0 else -1)
    return [dict(row) for row in ds]


def task_row(row: dict[str, Any]) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """(prompt messages, ground truth text, the payload (the row) the reward is called on)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in prompt or []]
    answer = row.get("answer")
    return messages, "" if answer is None else str(answer), row


def score(
    env: Any,
    payload: dict[str, Any],
    completion: list[dict[str, Any]],
    env_state: dict[str, Any] | None = None,
) -> dict[str, float]:
    """``{"score": weighted sum, <function>: its score, ...}`` of ``completion`` (the reply's messages)
    answering ``payload`` (a dataset row). ``env_state``: what a multi-turn environment kept in its state
    (spmdrl.rollout.vf_turns), which its reward functions may read. Raises what a reward function raised."""
    return asyncio.run(_score(env, payload, completion, env_state or {}))


async def _score(
    env: Any, payload: dict[str, Any], completion: list[dict[str, Any]], env_state: dict[str, Any]
) -> dict[str, float]:
    state = _state(payload, completion)
    state.update({k: v for k, v in env_state.items() if k not in state})
    out: dict[str, float] = {}
    total = 0.0
    for rubric, func, weight in reward_funcs(env.rubric):
        objects = rubric.score_objects(state)
        params = inspect.signature(func).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        kwargs = objects if takes_all else {k: v for k, v in objects.items() if k in params}
        value = func(**kwargs)
        if inspect.isawaitable(value):
            value = await value
        value = float(value)
        out[func.__name__] = value
        total += weight * value
    return {"score": total, **out}


def _state(payload: dict[str, Any], completion: list[dict[str, Any]]) -> Any:
    """The rollout State a rubric reads (as Environment.init_state makes it), after the completion's turns."""
    vf = importlib.import_module("verifiers.legacy")
    types = importlib.import_module("verifiers.legacy.types")
    messages = importlib.import_module("verifiers.legacy.utils.message_utils")
    row = copy.deepcopy(payload)
    if isinstance(row.get("info"), str):
        row["info"] = json.loads(row["info"])
    task = types.flatten_task_input(row)
    state = vf.State(input=task)
    state["task"] = task
    state["prompt"] = messages.normalize_messages(row.get("prompt") or [], field_name="input.prompt")
    state["completion"] = messages.normalize_messages(completion, field_name="completion")
    # One step per assistant turn, as a rollout records them (a MultiTurnEnv's num_turns metric counts them).
    said = [i for i, m in enumerate(state["completion"]) if m.role == "assistant"] or [len(completion) - 1]
    state["trajectory"] = [
        {"prompt": state["prompt"] + state["completion"][:i], "completion": state["completion"][i : i + 1]}
        for i in said
    ]
    state.update(is_completed=True, is_truncated=False, stop_condition=None, error=None, reward=None)
    return state


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)
