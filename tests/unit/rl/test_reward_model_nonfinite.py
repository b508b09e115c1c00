"""A reward model that scores NaN/inf (a broken checkpoint, an overflow) must not reach training silently
(spmdrl/rl/model_rewards.py, spmdrl/rl/samples.py::check_reward_errors): such a score is replaced by
reward.error_score, counted once per sample in reward/errors as a source of its own, and named with its
fix by the stop on reward.max_error_frac; a weighted reward that is still NaN/inf stops the step.

The reward model is a real one (the tiny backbone with a random scalar head, as in test_model_rewards.py)
whose embedding row of one token is NaN: every sample whose rendering holds that token scores NaN through
its real forward, the others stay finite."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from spmdrl.config import Config, JudgeConfig, RewardConfig, RewardModelConfig
from spmdrl.data.prompts import PromptExample
from spmdrl.models.load import load_tokenizer
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.model_rewards import ModelRewards
from spmdrl.rl.reward_model import RewardModel, encode_for_rm
from spmdrl.rl.samples import ScoredSamples, check_reward_errors
from spmdrl.rl.settings import reward_settings
from spmdrl.rollout.engine import Generation

CPU = torch.device("cpu")
ERROR_SCORE = -1.5
RESPONSES = ["#### 1", "#### banana", "#### 2", "banana #### 3"]  # samples 1 and 3 hold the poisoned token


def _cfg(*, weight: float = 2.0, max_error_frac: float = 0.25, error_score: float = ERROR_SCORE) -> Config:
    return Config(
        reward=RewardConfig(
            fn="mine", rule_weight=0.5, error_score=error_score, max_error_frac=max_error_frac
        ),
        reward_model=RewardModelConfig(enable=True, path="my_rm", weight=weight),
    )


def _samples(failed: list[bool] | None = None, responses: list[str] = RESPONSES) -> ScoredSamples:
    prompts = [
        PromptExample(i, [1, 2], [{"role": "user", "content": f"What is {i} + 1?"}], str(i + 1), "src", {})
        for i in range(2)
    ]
    gens = [Generation(i // 2, [5], [0.0], "stop") for i in range(4)]
    rule_B = torch.tensor([1.0, 0.0, 1.0, 0.0])
    failed_B = None if failed is None else torch.tensor(failed)
    num_failed = 0 if failed is None else sum(failed)
    rewards = RewardResult(rule_B, num_failed, 0, failed_B=failed_B)
    return ScoredSamples(prompts, gens, rewards, list(responses), rule_B.clone())


def _messages(samples: ScoredSamples) -> list[list[dict[str, str]]]:
    return [samples.prompts[g.prompt_index].messages for g in samples.gens]


def _poisoned_token(tok: object) -> int:
    """A token of the renderings of samples 1 and 3 that no other sample's rendering holds."""
    samples = _samples()
    ids, _ = encode_for_rm(tok, _messages(samples), samples.responses, 512)
    only_poisoned = (set(ids[1]) & set(ids[3])) - set(ids[0]) - set(ids[2])
    assert only_poisoned, "the tokenizer split 'banana' into tokens the other samples hold too"
    return min(only_poisoned)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> tuple[RewardModel, RewardModel]:
    """(a healthy reward model, the same weights with the embedding of a token only samples 1 and 3
    hold set to NaN)."""
    from spmdrl.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    tok = load_tokenizer(tiny)
    config = AutoConfig.from_pretrained(tiny, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    healthy = AutoModelForSequenceClassification.from_config(config).eval()
    torch.manual_seed(0)
    broken = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        broken.get_input_embeddings().weight[_poisoned_token(tok)] = float("nan")
    return (
        RewardModel(healthy, tok, micro_batch_size=3, max_length=512, device=CPU),
        RewardModel(broken, tok, micro_batch_size=3, max_length=512, device=CPU),
    )


def test_the_poisoned_model_scores_nan_on_its_samples_only(poisoned: tuple[RewardModel, RewardModel]) -> None:
    healthy, broken = poisoned
    samples = _samples()
    good_B = healthy.score(_messages(samples), samples.responses)
    bad_B = broken.score(_messages(samples), samples.responses)
    assert torch.isfinite(good_B).all()
    assert torch.isnan(bad_B).tolist() == [False, True, False, True]
    assert torch.equal(bad_B[[0, 2]], good_B[[0, 2]])


def test_nonfinite_scores_get_error_score_and_are_counted(
    poisoned: tuple[RewardModel, RewardModel], caplog: pytest.LogCaptureFixture
) -> None:
    healthy, broken = poisoned
    cfg = _cfg()
    samples = _samples()
    good_B = healthy.score(_messages(samples), samples.responses)
    rewards = ModelRewards(cfg.reward, cfg.reward_model, cfg.rollout.seed, broken, None, CPU)
    with caplog.at_level("WARNING"):
        out = rewards(samples, step=1)
    assert "reward model: 2 of 4 scores were NaN/inf (reward_model.path=my_rm)" in caplog.text
    # The model's part of samples 1 and 3 is reward.error_score; the others keep their real score.
    rm_B = torch.where(torch.tensor([False, True, False, True]), torch.tensor(ERROR_SCORE), good_B)
    expected = 0.5 * samples.rewards.scores_B + 2.0 * rm_B
    assert torch.isfinite(out.scores_B).all()
    assert torch.allclose(out.scores_B, expected, atol=1e-6)
    assert torch.allclose(out.rewards.scores_B, expected, atol=1e-6)
    r = out.rewards
    counts = (r.num_errors, r.num_timeouts, r.num_rm_nonfinite, r.num_rm_only, r.num_fn_failed)
    assert counts == (2, 0, 2, 2, 0)
    # The step's mean model score is over the finite ones; reward/rule_score is untouched.
    metrics = rewards.metrics()
    assert metrics["reward/rm_score"] == pytest.approx(float(good_B[[0, 2]].mean()), abs=1e-6)
    assert metrics["reward/rule_score"] == pytest.approx(0.5)
    # 2 of 4 is above 0.25: the stop names the reward model, its count and its fix, and not reward.fn.
    with pytest.raises(RuntimeError) as e:
        check_reward_errors(reward_settings(cfg), r, step=7, device=CPU)
    msg = str(e.value)
    assert msg.startswith("step 7: 2 of 4 samples (50%) got no score, above reward.max_error_frac=0.25 (or")
    assert "  - 2 reward-model scores were NaN/inf (reward_model.path=my_rm)" in msg
    assert "check the checkpoint" in msg and "model.param_dtype=auto" in msg
    assert "reward.fn" not in msg and "judge" not in msg
    # Under the limit the step goes on, on finite rewards.
    check_reward_errors(reward_settings(_cfg(max_error_frac=0.5)), r, step=7, device=CPU)


def test_a_sample_reward_fn_failed_too_counts_once(poisoned: tuple[RewardModel, RewardModel]) -> None:
    _, broken = poisoned
    cfg = _cfg()
    # reward.fn failed on samples 0 and 3; the model's NaN on 3 adds no sample, on 1 it adds one.
    out = ModelRewards(cfg.reward, cfg.reward_model, cfg.rollout.seed, broken, None, CPU)(
        _samples(failed=[True, False, False, True]), step=1
    )
    r = out.rewards
    assert (r.num_errors, r.num_rm_nonfinite, r.num_rm_only, r.num_fn_failed) == (3, 2, 1, 2)
    with pytest.raises(RuntimeError) as e:
        check_reward_errors(reward_settings(cfg), r, step=2, device=CPU)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("step 2: 3 of 4 samples (75%) got no score")
    assert lines[1].startswith("  - 2 from reward.fn=mine")
    assert lines[2].startswith(
        "  - 2 reward-model scores were NaN/inf (reward_model.path=my_rm; 1 of them on samples reward.fn"
    )


def test_a_zero_weight_model_still_counts_its_nan(poisoned: tuple[RewardModel, RewardModel]) -> None:
    # A broken model logged next to a rule-only reward is still a broken model, as an unparsed judge
    # reply is counted at any weight.
    _, broken = poisoned
    out = ModelRewards(
        _cfg(weight=0.0).reward,
        _cfg(weight=0.0).reward_model,
        _cfg(weight=0.0).rollout.seed,
        broken,
        None,
        CPU,
    )(_samples(), step=1)
    assert torch.equal(out.scores_B, 0.5 * torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert (out.rewards.num_errors, out.rewards.num_rm_nonfinite) == (2, 2)


def _stop(cfg: Config, scores_B: torch.Tensor) -> str:
    with pytest.raises(RuntimeError) as e:
        check_reward_errors(reward_settings(cfg), RewardResult(scores_B, 0, 0), step=4, device=CPU)
    return str(e.value)


def test_a_nonfinite_training_reward_stops_whatever_the_limit() -> None:
    # No source failed (no counts), yet a reward is not finite: stop, however many failures are allowed.
    cfg = _cfg(max_error_frac=1.0)
    msg = _stop(cfg, torch.tensor([1.0, math.inf, 0.0, math.nan]))
    assert msg.startswith(
        "step 4: 2 of 4 training rewards are NaN/inf; stopping rather than training on them"
    )
    assert "overflowed float32" in msg
    assert "(reward.rule_weight=0.5, reward_model.weight=2.0)" in msg and "judge.weight" not in msg
    # Its source named from the config: an error_score that is not finite, a weight that is not.
    assert "reward.error_score=nan is what every failed sample scores" in _stop(
        _cfg(error_score=math.nan), torch.tensor([math.nan, 1.0])
    )
    judged = Config(
        reward=RewardConfig(rule_weight=0.5),
        reward_model=RewardModelConfig(judge=JudgeConfig(enable=True, weight=math.inf)),
    )
    assert "reward_model.judge.weight=inf is not a finite number" in _stop(judged, torch.tensor([math.inf]))
    # Finite rewards pass.
    check_reward_errors(
        reward_settings(cfg), RewardResult(torch.tensor([1.0, -3.0e38]), 0, 0), step=4, device=CPU
    )


def test_an_overflowing_weight_is_caught_before_training(poisoned: tuple[RewardModel, RewardModel]) -> None:
    # Every part finite, the weighted sum not: a weight times a real model's scores past float32's range.
    healthy, _ = poisoned
    model = copy.deepcopy(healthy.model)
    with torch.no_grad():
        model.score.weight.mul_(1000.0)  # scores of tens of units (a reward model trained to a wide scale)
    rm = RewardModel(model, healthy.tokenizer, micro_batch_size=3, max_length=512, device=CPU)
    cfg = _cfg(weight=3.0e38, max_error_frac=1.0)
    samples = _samples()
    scores_B = rm.score(_messages(samples), samples.responses)
    assert torch.isfinite(scores_B).all() and (scores_B.abs() > 1.2).all(), scores_B  # x 3e38: past 3.4e38
    out = ModelRewards(cfg.reward, cfg.reward_model, cfg.rollout.seed, rm, None, CPU)(samples, step=1)
    assert out.rewards.num_rm_nonfinite == 0 and not torch.isfinite(out.scores_B).all()
    assert "overflowed float32" in _stop(cfg, out.rewards.scores_B)


# ------------------------------------------------------------------------- a broken checkpoint, 2 ranks


def _two_ranks(rank: int, world: int, rm_dir: str) -> dict:
    """The poisoned checkpoint loaded from disk as the runs load it (FSDP2 over both ranks); rank 0's
    samples are clean, rank 1's hold the poisoned token in 2 of 4."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmdrl.rl.reward_model import build_reward_model

    cfg = Config(
        reward=RewardConfig(fn="mine", rule_weight=0.5, error_score=ERROR_SCORE, max_error_frac=0.2),
        reward_model=RewardModelConfig(enable=True, path=rm_dir, weight=2.0, micro_batch_size_per_gpu=3),
    )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    rewards = ModelRewards(
        cfg.reward,
        cfg.reward_model,
        cfg.rollout.seed,
        build_reward_model(cfg.reward_model, cfg.model, mesh, CPU),
        None,
        CPU,
    )
    clean = ["#### 1", "#### 7", "#### 2", "#### 3"]
    out = rewards(_samples(responses=clean if rank == 0 else RESPONSES), step=5)
    metrics = rewards.metrics()
    try:
        check_reward_errors(reward_settings(cfg), out.rewards, step=5, device=CPU)
        stopped = None
    except RuntimeError as e:
        stopped = str(e)
    return {
        "finite": bool(torch.isfinite(out.scores_B).all()),
        "counts": (out.rewards.num_errors, out.rewards.num_rm_nonfinite, out.rewards.num_rm_only),
        "rm_score": metrics["reward/rm_score"],
        "stopped": stopped,
    }


def test_a_broken_checkpoint_stops_every_rank_with_the_summed_count(tmp_path) -> None:  # noqa: ANN001
    from spmdrl.testing.small_runs import save_random_reward_model
    from spmdrl.testing.spawn import run_distributed

    rm_dir = save_random_reward_model(tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight[_poisoned_token(load_tokenizer(rm_dir))] = float("nan")
    model.save_pretrained(rm_dir)  # the checkpoint on disk now holds NaN

    r0, r1 = run_distributed(_two_ranks, 2, str(rm_dir), timeout_s=300)
    assert r0["finite"] and r1["finite"]  # nothing NaN reaches the training reward
    assert r0["counts"] == (0, 0, 0) and r1["counts"] == (2, 2, 2)
    assert r0["rm_score"] == r1["rm_score"] and math.isfinite(r0["rm_score"])
    # 2 of 8 is above 0.2: both ranks stop, with the same message, the count summed over them.
    assert r0["stopped"] == r1["stopped"] and r0["stopped"] is not None
    assert r0["stopped"].startswith(
        "step 5: 2 of 8 samples (25%) got no score, above reward.max_error_frac=0.2"
    )
    assert f"  - 2 reward-model scores were NaN/inf (reward_model.path={rm_dir})" in r0["stopped"]


@pytest.mark.parametrize(
    "key", ["reward.error_score", "reward.rule_weight", "reward_model.weight", "reward_model.judge.weight"]
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_reward_settings_are_refused_at_load(key: str, value: str) -> None:
    from spmdrl.config_loader import load_config
    from spmdrl.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"{key} must be a finite number, got"):
        load_config(["recipe=grpo_tiny", f"{key}={value}"])
