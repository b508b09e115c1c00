"""reasoning-gym's tasks scored by their own ``score_answer``, and what the data source and the scorer share.

A row of a reasoning-gym task (spmdrl.data.reasoning_gym_task writes them) has the data source
``reasoning_gym/<task>`` and carries, in ``extra_info``, the task's config kwargs and the generated entry
(question, answer, metadata) as JSON: several tasks' scorers read the metadata, not the answer alone
(a puzzle with many solutions is checked, not compared). The answer is taken from the response the way
reasoning-gym's own evaluation takes it (``reasoning_gym.utils.extract_answer``: the last
``<answer>...</answer>``), then ``score_answer(answer, entry)`` of the task's dataset scores it.

Where it runs: in the reward sandbox's workers (registered untrusted in spmdrl.rewards.registry). The
scorers are plain Python, but some call sympy (the integration tasks), which has no time bound of its own,
and a few raise on an answer they cannot parse (prime_factorization on ``"abc"``). Importing reasoning-gym
takes about 2 s once per worker, not per sample; the dataset object a scorer needs is built once per
(task, config) in each worker.

A scorer that raises on the model's answer scores 0 (the answer is malformed, not the reward broken) and
is counted in ``reward/extra/scorer_raised``; ``reward/extra/answer_tag`` is the fraction of responses
with an ``<answer>`` tag, what a small model learns first.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from types import ModuleType
from typing import Any

from spmdrl.errors import ConfigError

PREFIX = "reasoning_gym/"
# The extra that installs reasoning-gym (pyproject.toml), with verifiers.
EXTRA = "envs"
INSTALL_HINT = f'pip install "spmdrl[{EXTRA}]"  (from a checkout: pip install -e ".[{EXTRA}]")'


class ReasoningGymMissingError(ConfigError):
    """A reasoning-gym task named without the reasoning-gym package installed."""


def is_installed() -> bool:
    try:
        return importlib.util.find_spec("reasoning_gym") is not None
    except (ImportError, ValueError):  # an import hook that refuses it, or a broken install
        return False


def require(why: str) -> ModuleType:
    """The reasoning_gym package, or :class:`ReasoningGymMissingError` naming the extra to install."""
    if not is_installed():
        raise ReasoningGymMissingError(
            f"{why} needs the reasoning-gym package, which is not installed; install the {EXTRA!r} extra: "
            f"{INSTALL_HINT}"
        )
    import reasoning_gym

    return reasoning_gym


def is_source(data_source: str) -> bool:
    return data_source.startswith(PREFIX)


def task_of(data_source: str) -> str:
    return data_source.removeprefix(PREFIX)


# ------------------------------------------------------------------------------------------ the entry as JSON
# Entries hold tuples (difficulty ranges, ARC grids), dicts with int keys (graph_color) and numpy scalars;
# plain JSON would hand the scorer lists and string keys, and some scorers then fail the right answer
# (arc_agi compares grids as tuples). Tagged JSON keeps the types the scorers compare.
_TUPLE, _ITEMS = "__tuple__", "__items__"


def _tag(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE: [_tag(v) for v in value]}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {_TUPLE, _ITEMS} & set(value):
            return {k: _tag(v) for k, v in value.items()}
        return {_ITEMS: [[_tag(k), _tag(v)] for k, v in value.items()]}
    if hasattr(value, "item") and callable(value.item):  # a numpy scalar
        return value.item()
    return value


def _untag(value: Any) -> Any:
    if isinstance(value, list):
        return [_untag(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_untag(v) for v in value[_TUPLE])
        if set(value) == {_ITEMS}:
            return {_hashable(_untag(k)): _untag(v) for k, v in value[_ITEMS]}
        return {k: _untag(v) for k, v in value.items()}
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def encode_entry(entry: dict[str, Any]) -> str:
    return json.dumps(_tag(entry), sort_keys=False)


def decode_entry(text: str) -> dict[str, Any]:
    return _untag(json.loads(text))


# ------------------------------------------------------------------------------------------ scoring


@functools.lru_cache(maxsize=64)
def scoring_dataset(task: str, config_json: str) -> Any:
    """The task's dataset object with the row's config kwargs (its ``score_answer`` may read the config),
    built once per worker."""
    rg = require(f"scoring data_source {PREFIX}{task}")
    return rg.create_dataset(task, size=1, seed=0, **json.loads(config_json))


def compute_score(response: str, data_source: str, extra_info: dict[str, Any]) -> dict[str, float]:
    """The task's own score of the response's ``<answer>``, in [0, 1], with ``answer_tag`` and
    ``scorer_raised`` (module docstring). Raises ValueError for a row spmdrl's source did not write."""
    task = task_of(data_source)
    if not isinstance(extra_info, dict) or not {"entry", "config"} <= set(extra_info):
        raise ValueError(
            f"data_source {data_source!r}: extra_info must hold the generated entry and the task's config "
            f"(keys 'entry', 'config'), as data.source=reasoning_gym:{task} writes them; got "
            f"{sorted(extra_info) if isinstance(extra_info, dict) else type(extra_info).__name__}"
        )
    dataset = scoring_dataset(task, extra_info["config"])
    entry = decode_entry(extra_info["entry"])
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(response)
    raised = 0.0
    try:
        score = float(dataset.score_answer(answer, entry))
    except Exception:  # the scorer could not read the model's answer: a wrong answer, not a broken reward
        score, raised = 0.0, 1.0
    if math.isfinite(score):
        score = min(max(score, 0.0), 1.0)
    return {"score": score, "answer_tag": float(answer is not None), "scorer_raised": raised}
