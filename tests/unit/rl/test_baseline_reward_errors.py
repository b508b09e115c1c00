"""ReMax's greedy baselines pass the same reward stop as the samples (recipes/grpo.py remax_baseline ->
spmdrl.rl.samples.check_reward_errors with ``what``): a baseline at reward.error_score would be a wrong
advantage for every sample of its prompt, so failing baselines stop the run, and the message says that
it was the baselines that failed. (The recipe's call runs in tests/integration/test_grpo_e2e.py's remax run.)"""

from __future__ import annotations

import pytest
import torch

from spmdrl.config import Config, RewardConfig
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.samples import check_reward_errors
from spmdrl.rl.settings import reward_settings

CPU = torch.device("cpu")


def test_failing_baselines_stop_and_are_named() -> None:
    cfg = Config(reward=RewardConfig(fn="tiny", max_error_frac=0.25))
    what = "greedy ReMax baselines"
    check_reward_errors(
        reward_settings(cfg), RewardResult(torch.zeros(4), 1, 0), step=3, device=CPU, what=what
    )
    with pytest.raises(RuntimeError, match=r"step 3: 2 of 4 greedy ReMax baselines \(50%\) got no score"):
        check_reward_errors(
            reward_settings(cfg), RewardResult(torch.zeros(4), 2, 0), step=3, device=CPU, what=what
        )
    with pytest.raises(RuntimeError, match=r"1 of 4 training rewards \(greedy ReMax baselines\) are NaN/inf"):
        nan = torch.tensor([0.0, float("nan"), 0.0, 0.0])
        check_reward_errors(reward_settings(cfg), RewardResult(nan, 0, 0), step=3, device=CPU, what=what)
