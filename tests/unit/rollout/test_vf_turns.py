"""A verifiers 0.3.x MultiTurnEnv's turns (spmdrl.rollout.vf_turns) on the real verifiers objects:
tests/envs/vf_guess_legacy (a number-guessing game) driven turn by turn as the agent loop drives it, in a
subprocess whose PYTHONPATH puts verifiers 0.3.1 (its legacy API) first; the env's failures (raise, hang,
rewrite) as end reasons; its conversation and state scored by the rubric in the reward's signature; and
an env with tools (a ToolEnv's way): the turn's <tool_call> blocks as its tool_calls, its tools' schemas."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.vf_envs import pythonpath

ENV = "vf_guess_legacy"
PROBE = textwrap.dedent(
    """
    import json, sys, time
    from spmdrl.envs.config import EnvConfig
    from spmdrl.envs.rows import env_rows
    from spmdrl.envs.setup import env_reward, load_env
    from spmdrl.errors import ConfigError
    from spmdrl.rollout.config import MultiTurnConfig
    from spmdrl.rollout.vf_turns import VfTurnEnv, check_env_turns

    out = {}
    def game(**args):
        cfg = EnvConfig(source="verifiers:vf_guess_legacy", args={"num_train": 4, "num_eval": 2, **args})
        loaded = load_env(cfg)
        return cfg, loaded, env_rows(loaded, cfg).train[0]

    cfg, loaded, row = game()
    secret = int(row["reward_model"]["ground_truth"])
    wrong = 1 if secret != 1 else 2
    env = VfTurnEnv(loaded, call_timeout_s=5.0)
    s = env.open(row["extra_info"])
    said = [f"#### {wrong}", "no guess", f"my guess #### {secret}"]
    replies = [env.reply(s, text) for text in said]
    out["replies"] = [[r.messages, r.end] for r in replies]
    messages = []
    for text, r in zip(said, replies):
        messages += [{"role": "assistant", "content": text}, *r.messages]
    extra = env.finish(s, messages)
    out["extra"] = extra
    fn = env_reward(cfg)
    out["score"] = fn("ignored", str(secret), data_source="", extra_info={**row["extra_info"], **extra})
    out["turns"] = [check_env_turns(cfg, MultiTurnConfig(max_assistant_turns=4), 30)]
    for mt in (MultiTurnConfig(enable=True, tools=["calculator"]), MultiTurnConfig(tool_timeout_s=1800)):
        try:
            check_env_turns(cfg, mt, 30)
        except ConfigError as e:
            out["turns"].append(str(e))

    # The env's own max_turns, and each failure.
    for name, args, timeout in (
        ("max_turns", {"max_turns": 2}, 5.0),
        ("raise", {"raise_on_turn": 1}, 5.0),
        ("hang", {"hang_on_turn": 1}, 0.5),
        ("rewrite", {"rewrite_on_turn": 1}, 5.0),
    ):
        _, loaded, row = game(**args)
        env = VfTurnEnv(loaded, call_timeout_s=timeout)
        s = env.open(row["extra_info"])
        t0 = time.monotonic()
        ends = [env.reply(s, "#### 0").end for _ in range(2)]
        out[name] = [ends, time.monotonic() - t0, env.finish(s, []).get("env_state")]
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    env = {"PYTHONPATH": pythonpath(ENV, legacy=True), "PATH": "/usr/bin:/bin"}
    script = PROBE + TOOL_PROBE  # one interpreter: importing verifiers and datasets is most of the time
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in res.stdout.splitlines() if line.startswith(("RESULT ", "TOOLS "))]
    assert res.returncode == 0 and len(lines) == 2, res.stderr[-3000:]
    out = json.loads(lines[0].removeprefix("RESULT "))
    out["tools"] = json.loads(lines[1].removeprefix("TOOLS "))
    return out


def test_the_game_is_driven_turn_by_turn_until_its_stop_condition(probe: dict[str, Any]) -> None:
    (first, end1), (second, end2), (last, end3) = probe["replies"]
    assert first in ([{"role": "user", "content": "Higher."}], [{"role": "user", "content": "Lower."}])
    assert (end1, end2) == ("", "")
    assert second == [{"role": "user", "content": "Write a number after ####."}]
    assert (last, end3) == ([], "stop")  # the right guess: the env's `guessed` stop condition


def test_the_conversation_and_the_state_reach_the_rubric(probe: dict[str, Any]) -> None:
    extra = probe["extra"]
    assert [m["role"] for m in extra["env_completion"]] == [
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    state = extra["env_state"]
    assert state["guesses"][1] is None and state["stop_condition"] == "guessed"
    assert "trajectory" not in state and "prompt" not in state  # verifiers' own entries stay behind
    # won: the last assistant message guessed right; guesses_made reads the env's state (weight 0).
    assert probe["score"]["won"] == 1.0 and probe["score"]["guesses_made"] == 2.0
    assert probe["score"]["score"] == 1.0


def test_max_turns_and_each_failure_end_the_trajectory_with_its_reason(probe: dict[str, Any]) -> None:
    assert probe["max_turns"][0] == ["", "max_turns"]
    # A failure ends the trajectory at once, and the session stays ended.
    assert probe["raise"][0] == ["env_error", "env_error"]
    assert probe["rewrite"][0] == ["env_rewrite", "env_rewrite"]
    ends, took, _ = probe["hang"]
    assert ends == ["env_timeout", "env_timeout"] and took < 3.0  # abandoned after 0.5 s, not awaited


def test_the_turns_must_fit_rollout_multi_turn(probe: dict[str, Any]) -> None:
    ok, refused, too_long = probe["turns"]
    assert ok.startswith("multi-turn: up to 4 assistant turns")
    assert "rollout.multi_turn.enable=false" in refused
    assert "tool_timeout_s=1800" in too_long and "trainer.collective_timeout_min=30 minutes" in too_long


TOOL_PROBE = textwrap.dedent(
    """
    import json
    import verifiers as vf
    from datasets import Dataset
    from spmdrl.envs.legacy import score
    from spmdrl.envs.load import LEGACY, LoadedEnv
    from spmdrl.envs.rows import TASK_KEY
    from spmdrl.rollout.vf_turns import VfTurnEnv, check_env_turns, tool_schemas

    # A ToolEnv's way (its import needs verifiers' `all` extra): tool_defs, env_response running the last
    # message's tool_calls, and a stop when a turn calls none.
    class CalcEnv(vf.MultiTurnEnv):
        @vf.stop
        async def no_tools_called(self, state) -> bool:
            return bool(state["trajectory"]) and not state["trajectory"][-1]["completion"][-1].tool_calls

        async def env_response(self, messages, state, **kwargs):
            return [vf.ToolMessage(content=str(sum(json.loads(c.arguments).values())), tool_call_id=c.id)
                    for c in messages[-1].tool_calls]

    add = vf.Tool(name="add", description="Adds two numbers.", parameters={
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5", "example_id": 0}
    def right(completion, answer) -> float:
        return 1.0 if answer in (completion[-1]["content"] or "") else 0.0
    def calls(completion) -> float:
        return float(sum(len(m.get("tool_calls") or []) for m in completion if m["role"] == "assistant"))
    env = CalcEnv(tool_defs=[add], max_turns=4, dataset=Dataset.from_list([row]),
                  rubric=vf.Rubric(funcs=[right, calls], weights=[1.0, 0.0]))
    loaded = LoadedEnv("verifiers:calc", "calc", LEGACY, env, True, "0.3.1")
    turns = VfTurnEnv(loaded, call_timeout_s=5.0)
    s = turns.open({TASK_KEY: json.dumps(row)})
    said = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    replies = [turns.reply(s, t) for t in said]
    messages = [{"role": "assistant", "content": said[0]}, *replies[0].messages,
                {"role": "assistant", "content": said[1]}]
    extra = turns.finish(s, messages)
    out = {
        "schemas": tool_schemas(loaded),
        "replies": [[r.messages, r.end] for r in replies],
        "completion": extra["env_completion"],
        "score": score(env, row, extra["env_completion"]),
    }
    print("TOOLS " + json.dumps(out))
    """
)


def test_a_tool_env_sees_the_turns_tool_calls_and_its_tools_reach_the_prompt(probe: dict[str, Any]) -> None:
    out = probe["tools"]
    (schema,) = out["schemas"]
    assert schema["function"]["name"] == "add" and set(schema["function"]["parameters"]["properties"]) == {
        "a",
        "b",
    }
    (calls, end1), (_, end2) = out["replies"]
    assert calls == [{"role": "tool", "content": "5", "tool_call_id": "call_0"}] and end1 == ""
    assert end2 == "stop"  # no call in the turn: the env's no_tools_called
    assert out["completion"][0]["tool_calls"] == [
        {"id": "call_0", "name": "add", "arguments": '{"a": 2, "b": 3}'}
    ]
    # The rubric reads the conversation's calls (as ToolEnv's tool-call metrics do).
    assert out["score"]["right"] == 1.0 and out["score"]["calls"] == 1.0
