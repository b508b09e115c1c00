"""spmdrl/rl/model_rewards.py: a step's samples rescored by a real (tiny, random) reward model and
weighted with the rule reward; the step's reward/* metrics; ReMax's unrecorded calls. One process, the
reward model a plain transformers module (its FSDP2 build runs in tests/integration/test_reward_models.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from spmdrl.config import Config, RewardConfig, RewardModelConfig
from spmdrl.data.prompts import PromptExample
from spmdrl.models.load import load_tokenizer
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.model_rewards import ModelRewards
from spmdrl.rl.reward_model import RewardModel
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rollout.engine import Generation

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory: pytest.TempPathFactory) -> RewardModel:
    from spmdrl.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    tok = load_tokenizer(tiny)
    config = AutoConfig.from_pretrained(tiny, num_labels=1, pad_token_id=tok.pad_token_id)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    return RewardModel(model, tok, micro_batch_size=3, max_length=512, device=CPU)


def _samples() -> ScoredSamples:
    prompts = [
        PromptExample(i, [1, 2], [{"role": "user", "content": f"What is {i} + 1?"}], str(i + 1), "src", {})
        for i in range(2)
    ]
    gens = [Generation(i // 2, [5], [0.0], "stop") for i in range(4)]
    responses = ["#### 1", "#### 7", "#### 2", "#### 3"]
    rule_B = torch.tensor([1.0, 0.0, 1.0, 0.0])
    return ScoredSamples(prompts, gens, RewardResult(rule_B, 0, 0), responses, rule_B.clone())


def test_weighted_with_the_rule(reward_model: RewardModel) -> None:
    cfg = Config(
        reward=RewardConfig(rule_weight=0.5),
        reward_model=RewardModelConfig(enable=True, path="x", weight=2.0),
    )
    rewards = ModelRewards(cfg.reward, cfg.reward_model, cfg.rollout.seed, reward_model, None, CPU)
    samples = _samples()
    out = rewards(samples, step=1)
    messages = [samples.prompts[g.prompt_index].messages for g in samples.gens]
    rm_B = reward_model.score(messages, samples.responses)
    expected = 0.5 * samples.rewards.scores_B + 2.0 * rm_B
    assert torch.allclose(out.scores_B, expected, atol=1e-6)
    assert torch.allclose(out.rewards.scores_B, expected, atol=1e-6)
    assert out.rewards.num_errors == 0 and out.responses == samples.responses
    metrics = rewards.metrics()
    assert metrics["reward/rule_score"] == pytest.approx(0.5)
    assert metrics["reward/rm_score"] == pytest.approx(float(rm_B.mean()), abs=1e-6)
    assert metrics["reward/rm_truncated_frac"] == 0.0
    assert "reward/judge_score" not in metrics
    # The sums start over after metrics(); ReMax's baseline calls are not recorded.
    rewards(samples, step=2, record=False)
    assert rewards.metrics()["reward/rule_score"] == 0.0


def test_shaping_already_applied_stays_on_top(reward_model: RewardModel) -> None:
    cfg = Config(reward=RewardConfig(rule_weight=0.0), reward_model=RewardModelConfig(enable=True, path="x"))
    samples = _samples()
    shaped = ScoredSamples(
        samples.prompts, samples.gens, samples.rewards, samples.responses, samples.scores_B - 0.25
    )
    out = ModelRewards(cfg.reward, cfg.reward_model, cfg.rollout.seed, reward_model, None, CPU)(
        shaped, step=1
    )
    assert torch.allclose(out.scores_B, out.rewards.scores_B - 0.25, atol=1e-6)
