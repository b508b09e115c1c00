"""The environment's rubric (0.3.x) or reward methods (0.4) as spmdrl's reward function.

:class:`EnvReward` takes the reward signature (``response, ground_truth, *, data_source, extra_info``)
and returns ``{"score": <weighted total>, <function>: <its score>, ...}``, so each rubric function's
score is logged as ``reward/extra/<function>`` (docs/rewards.md). It runs in the reward workers like any
untrusted reward.fn (spmdrl.rewards.sandbox): a function that raises, hangs past reward.timeout_s or
returns no finite number is a failed sample, counted and bounded by reward.max_error_frac. It pickles as
its env.source and env.args; a worker loads the environment as it unpickles it (within the worker's start
timeout, not a sample's), once per worker process.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from spmdrl.envs.load import LEGACY, LoadedEnv, load_verifiers_env
from spmdrl.envs.rows import TASK_KEY

# extra_info key a multi-turn rollout sets: the messages after the prompt (the replies, tool results and
# environment turns), scored instead of the single reply.
COMPLETION_KEY = "env_completion"
# extra_info key of a multi-turn 0.3.x environment's state after its turns (its JSON-safe entries).
STATE_KEY = "env_state"


@dataclass(frozen=True)
class EnvReward:
    source: str  # env.source
    name: str
    # env.args as sorted JSON: hashable (the sandbox groups samples by their function) and the cache key.
    args_json: str = "{}"

    def __call__(
        self, response: str, ground_truth: str, *, data_source: str, extra_info: dict[str, Any]
    ) -> dict[str, float]:
        loaded = cached_env(self.source, self.name, self.args_json)
        payload = json.loads(extra_info[TASK_KEY])
        completion = extra_info.get(COMPLETION_KEY) or [{"role": "assistant", "content": response}]
        if loaded.generation == LEGACY:
            from spmdrl.envs import legacy

            return legacy.score(loaded.env, payload, completion, extra_info.get(STATE_KEY))
        from spmdrl.envs import v1

        return v1.score(loaded.env, payload, completion)

    def __reduce__(self) -> tuple[Any, tuple[str, str, str]]:
        return (_arrive, (self.source, self.name, self.args_json))


def _arrive(source: str, name: str, args_json: str) -> EnvReward:
    """An EnvReward unpickled in a worker: its environment loaded now, before the first sample's clock."""
    cached_env(source, name, args_json)
    return EnvReward(source, name, args_json)


@functools.lru_cache(maxsize=4)
def cached_env(source: str, name: str, args_json: str) -> LoadedEnv:
    """The environment loaded once per process (the rank's start, a reward worker)."""
    return load_verifiers_env(source, name, json.loads(args_json))
