"""The judge's share of reward.max_error_frac's stop (spmdrl/rl/samples.py::check_reward_errors) from a
real Judge on a real in-process vLLM engine (the tiny model, on the CPU): its unparsed replies are counted
once per sample and named beside reward.fn's failures. (Moved from the unit tier, where the counting and
the wording are tested on made-up counts: tests/unit/rl/test_reward_error_sources.py.)"""

from __future__ import annotations

import torch

from spmdrl.config import RolloutConfig
from spmdrl.data.prompts import PromptExample
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.samples import ScoredSamples, check_reward_errors
from spmdrl.rl.settings import reward_settings
from spmdrl.rollout.engine import Generation
from spmdrl.testing.spawn import run_distributed
from tests.unit.rl.test_reward_error_sources import CPU, _cfg


def _judged(rank: int, world: int, model_dir: str) -> dict:
    """The model rewards with a real judge on a real engine, over samples reward.fn failed one of."""
    from pathlib import Path

    from spmdrl.models.load import load_tokenizer
    from spmdrl.rl.judge import Judge
    from spmdrl.rl.model_rewards import ModelRewards
    from spmdrl.rollout.engine import build_engine

    cfg = _cfg()
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(cpu_kvcache_gib=0.25, dtype="float32", cpu_gemm="torch"),
        max_model_len=256,
        device_type="cpu",
    )
    tok = load_tokenizer(Path(model_dir))
    judge = Judge(cfg.reward_model.judge, engine, tok, max_model_len=256, error_score=0.0)
    prompts = [
        PromptExample(i, [1], [{"role": "user", "content": f"What is {i} + 1?"}], str(i + 1), "src", {})
        for i in range(2)
    ]
    gens = [Generation(i // 2, [5], [0.0], "stop") for i in range(4)]
    rule_B = torch.tensor([0.0, 1.0, 1.0, 0.0])
    # reward.fn failed on sample 0 (an error), scored the others.
    fn_result = RewardResult(rule_B, 1, 0, failed_B=torch.tensor([True, False, False, False]))
    samples = ScoredSamples(prompts, gens, fn_result, ["1", "2", "2", "3"], rule_B.clone())
    rewards = ModelRewards(cfg.reward, cfg.reward_model, cfg.rollout.seed, None, judge, CPU)
    out = rewards(samples, step=1).rewards
    metrics = rewards.metrics()
    try:
        check_reward_errors(reward_settings(cfg), out, step=1, device=CPU)
        stopped = None
    except RuntimeError as e:
        stopped = str(e)
    engine.close()
    return {
        "counts": (out.num_errors, out.num_timeouts, out.num_judge_errors, out.num_judge_only),
        "parsed_frac": metrics["reward/judge_parsed_frac"],
        "replies": judge.last_replies,
        "stopped": stopped,
    }


def test_real_judge_failures_are_counted_once_per_sample_and_named(tmp_path) -> None:  # noqa: ANN001
    from spmdrl.models.tiny import ensure_tiny_model

    r = run_distributed(_judged, 1, str(ensure_tiny_model(tmp_path)), timeout_s=300)[0]
    assert len(r["replies"]) == 4 and not any("QQQ" in x for x in r["replies"]), r["replies"]
    # 4 unparsed replies; sample 0's reward.fn had failed already: 1 + 3 samples without a score.
    assert r["counts"] == (4, 0, 4, 3) and r["parsed_frac"] == 0.0
    assert r["stopped"].startswith("step 1: 4 of 4 samples (100%) got no score, above"), r["stopped"]
    assert "1 from reward.fn=mine" in r["stopped"]
    assert "4 judge replies that did not parse (reward_model.judge.*; 1 of them on samples" in r["stopped"]
