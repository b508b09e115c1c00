"""Advantage estimators against values computed independently: by hand, or by plain-Python loops written
here from the papers' / verl's formulas (``statistics`` for means and unbiased stds, no tensors)."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

from spmdrl.algos.advantages import (
    ADV_ESTIMATORS,
    AdvantageInputs,
    adv_estimator,
    compute_advantages,
    register_adv_estimator,
    token_level_rewards,
)
from spmdrl.config import AlgorithmConfig, Config, ConfigError, validate

VERL_NAMES = {
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "grpo_passk",
    "gpg",
    "grpo_vectorized",
    "rloo_vectorized",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
}


def _mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.tensor([[t < n for t in range(T)] for n in lengths])


def _outcome(scores: list[float], lengths: list[int], ids: list[int], T: int = 4, **kw) -> AdvantageInputs:
    mask_BT = _mask(lengths, T)
    return AdvantageInputs(
        token_rewards_BT=token_level_rewards(torch.tensor(scores), mask_BT),
        response_mask_BT=mask_BT,
        group_ids_B=torch.tensor(ids),
        **kw,
    )


def _broadcast_ref(per_seq: list[float], lengths: list[int], T: int) -> torch.Tensor:
    return torch.tensor(
        [[a if t < n else 0.0 for t in range(T)] for a, n in zip(per_seq, lengths, strict=True)]
    )


def _whiten_ref(rows: list[list[float]], mask: list[list[bool]]) -> torch.Tensor:
    """Mean and unbiased std over the valid entries of the whole batch; 0 where masked."""
    flat = [x for row, m in zip(rows, mask, strict=True) for x, v in zip(row, m, strict=True) if v]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    return torch.tensor(
        [
            [(x - mean) / math.sqrt(var + 1e-8) if v else 0.0 for x, v in zip(row, m, strict=True)]
            for row, m in zip(rows, mask, strict=True)
        ]
    )


# Non-consecutive, unequal groups: 7 has three samples (positions 0, 2, 5), 3 has two (1, 4), 9 one (3).
SCORES = [1.0, 0.5, 0.0, 0.7, -0.5, 0.25]
LENGTHS = [4, 2, 3, 1, 4, 2]
IDS = [7, 3, 7, 9, 3, 7]


def _groups_ref(scores: list[float], ids: list[int]) -> dict[int, list[float]]:
    groups: dict[int, list[float]] = {}
    for s, g in zip(scores, ids, strict=True):
        groups.setdefault(g, []).append(s)
    return groups


# ---------------------------------------------------------------------------------------------- inputs


def test_token_level_rewards_puts_score_on_last_valid_token():
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    rewards_BT = token_level_rewards(torch.tensor([2.0, -1.0, 5.0, 0.5]), mask_BT)
    expected = torch.tensor([[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0.5]])
    assert rewards_BT.dtype == torch.float32
    torch.testing.assert_close(rewards_BT, expected)


def test_inputs_check_shapes():
    mask_BT = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="group_ids_B"):
        AdvantageInputs(torch.zeros(2, 3), mask_BT, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="response_mask_BT"):
        AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="values_BT"):
        AdvantageInputs(torch.zeros(2, 3), mask_BT, torch.tensor([0, 1]), values_BT=torch.zeros(2))
    with pytest.raises(ValueError, match="baseline_B"):
        AdvantageInputs(torch.zeros(2, 3), mask_BT, torch.tensor([0, 1]), baseline_B=torch.zeros(3))


# ---------------------------------------------------------------------------------------------- registry


def test_registry_has_exactly_verls_names_and_clear_errors():
    assert set(ADV_ESTIMATORS) == VERL_NAMES
    # What each declares at registration, next to the function.
    assert {n for n in ADV_ESTIMATORS if adv_estimator(n).needs_critic} == {"gae"}
    assert {n for n in ADV_ESTIMATORS if adv_estimator(n).needs_baseline} == {"remax"}
    assert {n for n in ADV_ESTIMATORS if adv_estimator(n).needs_sum_pi_squared} == {
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
    }
    inputs = _outcome([1.0, 0.0], [2, 2], [0, 0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo.*reinforce_plus_plus"):
        compute_advantages("ppo", inputs)
    with pytest.raises(ValueError, match="needs a critic.*recipe=ppo_tiny"):
        compute_advantages("gae", inputs)
    with pytest.raises(ValueError, match="baseline_B"):
        compute_advantages("remax", inputs)


def _critic_only(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A user's estimator: the critic's values as the advantages."""
    assert inputs.values_BT is not None
    values_BT = torch.where(inputs.response_mask_BT.bool(), inputs.values_BT.float(), 0.0)
    return values_BT, values_BT


def test_a_decorated_estimator_is_selectable_and_its_declared_needs_are_checked():
    register_adv_estimator("spmdrl_test_critic_only", needs_critic=True)(_critic_only)
    try:
        validate(Config(algorithm=AlgorithmConfig(adv_estimator="spmdrl_test_critic_only")))
        assert adv_estimator("spmdrl_test_critic_only").needs_critic  # the recipe builds a critic for it
        inputs = _outcome([1.0, 0.0], [2, 1], [0, 0], T=2)
        with pytest.raises(ValueError, match="'spmdrl_test_critic_only' needs a critic"):
            compute_advantages("spmdrl_test_critic_only", inputs)
        values_BT = torch.tensor([[0.5, -1.0], [2.0, 3.0]])
        advantages_BT, _ = compute_advantages(
            "spmdrl_test_critic_only", dataclasses.replace(inputs, values_BT=values_BT)
        )
        torch.testing.assert_close(advantages_BT, torch.tensor([[0.5, -1.0], [2.0, 0.0]]))
    finally:
        ADV_ESTIMATORS.unregister("spmdrl_test_critic_only")
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='spmdrl_test_critic_only': unknown"):
        validate(Config(algorithm=AlgorithmConfig(adv_estimator="spmdrl_test_critic_only")))


def test_an_estimator_by_import_path(tmp_path, monkeypatch):
    pkg = tmp_path / "spmdrl_test_adv_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "adv.py").write_text(
        "import torch\n"
        "from spmdrl.algos.advantages import register_adv_estimator\n"
        "def raw_score(inputs):\n"
        "    a = inputs.token_rewards_BT.float()\n"
        "    return a, a\n"
        "@register_adv_estimator('spmdrl_test_greedy_gap', needs_baseline=True)\n"
        "def greedy_gap(inputs):\n"
        "    a = inputs.token_rewards_BT.float() - inputs.baseline_B[:, None]\n"
        "    return a, a\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        validate(Config(algorithm=AlgorithmConfig(adv_estimator="spmdrl_test_adv_pkg.adv:raw_score")))
        inputs = _outcome([1.0, 0.5], [1, 1], [0, 0], T=1)
        advantages_BT, _ = compute_advantages("spmdrl_test_adv_pkg.adv:raw_score", inputs)
        torch.testing.assert_close(advantages_BT, torch.tensor([[1.0], [0.5]]))
        # A decorated function named by path keeps what it declared.
        assert adv_estimator("spmdrl_test_adv_pkg.adv:greedy_gap").needs_baseline
        assert not adv_estimator("spmdrl_test_adv_pkg.adv:raw_score").needs_baseline
        with pytest.raises(ConfigError, match="no module named 'spmdrl_test_no_pkg'.*PYTHONPATH"):
            validate(Config(algorithm=AlgorithmConfig(adv_estimator="spmdrl_test_no_pkg.adv:raw_score")))
    finally:
        ADV_ESTIMATORS.unregister("spmdrl_test_greedy_gap")


@pytest.mark.parametrize("name", sorted(VERL_NAMES))
def test_every_estimator_zero_where_masked_and_finite(name: str):
    T = 5
    mask_BT = _mask([5, 2, 3, 1, 4, 2], T)
    kl_BT = torch.linspace(-0.3, 0.3, 6 * T).view(6, T)  # per-token terms, as a KL penalty in the reward
    inputs = AdvantageInputs(
        token_rewards_BT=token_level_rewards(torch.tensor(SCORES), mask_BT) + kl_BT * mask_BT,
        response_mask_BT=mask_BT,
        # grpo_passk needs groups of >= 2: merge the singleton into group 3 for it.
        group_ids_B=torch.tensor([7, 3, 7, 3, 3, 7] if name == "grpo_passk" else IDS),
        # NaN at padding must not leak: values there are whatever the critic output on pad tokens.
        values_BT=torch.where(mask_BT, torch.linspace(0, 1, 6 * T).view(6, T), float("nan")),
        baseline_B=torch.full((6,), 0.3),
        old_logprobs_BT=torch.where(mask_BT, -torch.linspace(0.1, 2.0, 6 * T).view(6, T), float("nan")),
        sum_pi_squared_BT=torch.where(mask_BT, torch.linspace(0.2, 0.9, 6 * T).view(6, T), float("nan")),
        reward_components_BK=torch.stack([torch.tensor(SCORES), torch.tensor(SCORES).flip(0)], dim=1),
        gamma=0.9,
        lam=0.8,
    )
    advantages_BT, returns_BT = compute_advantages(name, inputs)
    for out_BT in (advantages_BT, returns_BT):
        assert out_BT.shape == (6, T) and out_BT.dtype == torch.float32
        assert torch.isfinite(out_BT).all()
        assert (out_BT[~mask_BT] == 0).all()
    assert advantages_BT[mask_BT].abs().sum() > 0


# ---------------------------------------------------------------------------------------------- grpo


def _grpo_ref(scores: list[float], ids: list[int], norm: bool, eps: float = 1e-6) -> list[float]:
    groups = _groups_ref(scores, ids)
    out = []
    for s, g in zip(scores, ids, strict=True):
        # verl: a group of one has mean 0 and std 1.
        mean, std = (
            (0.0, 1.0) if len(groups[g]) == 1 else (statistics.fmean(groups[g]), statistics.stdev(groups[g]))
        )
        out.append((s - mean) / (std + eps) if norm else s - mean)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_non_consecutive_groups_and_group_of_one(norm: bool):
    advantages_BT, returns_BT = compute_advantages("grpo", _outcome(SCORES, LENGTHS, IDS, norm_by_std=norm))
    expected = _broadcast_ref(_grpo_ref(SCORES, IDS, norm), LENGTHS, 4)
    torch.testing.assert_close(advantages_BT, expected)
    torch.testing.assert_close(returns_BT, expected)
    # The group of one (position 3) keeps its raw reward 0.7, / (1 + eps) when normalising.
    assert advantages_BT[3, 0].item() == pytest.approx(0.7 / (1 + 1e-6) if norm else 0.7)


def test_grpo_by_hand():
    # Group 0: [1, 0, 0, 1], mean 0.5, unbiased std 1/sqrt(3); group 1: [1, 1], std 0 -> advantage
    # 0 / (0 + eps) = 0 (the eps is what keeps an all-equal group from 0/0).
    inputs = _outcome([1.0, 1.0, 0.0, 1.0, 0.0, 1.0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 0], T=1)
    s = math.sqrt(3) / 2
    advantages_BT, _ = compute_advantages("grpo", inputs)
    torch.testing.assert_close(
        advantages_BT[:, 0], torch.tensor([s, 0.0, -s, 0.0, -s, s]), atol=1e-5, rtol=1e-5
    )


# ---------------------------------------------------------------------------------------------- rloo


def test_rloo_leave_one_out_and_group_of_one():
    advantages_BT, returns_BT = compute_advantages("rloo", _outcome(SCORES, LENGTHS, IDS))
    ref = []
    for i, (s, g) in enumerate(zip(SCORES, IDS, strict=True)):
        others = [SCORES[j] for j in range(len(SCORES)) if IDS[j] == g and j != i]
        ref.append(s - statistics.fmean(others) if others else s)  # a group of one: raw reward (verl)
    torch.testing.assert_close(advantages_BT, _broadcast_ref(ref, LENGTHS, 4))
    torch.testing.assert_close(returns_BT, advantages_BT)
    # By hand: group 7 = [1, 0, 0.25] -> 1 - 0.125, 0 - 0.625, 0.25 - 0.5.
    torch.testing.assert_close(advantages_BT[[0, 2, 5], 0], torch.tensor([0.875, -0.625, -0.25]))


# ---------------------------------------------------------------------------------------------- reinforce++


def test_reinforce_plus_plus_discounted_returns_carried_across_masked_span_then_whitened():
    gamma = 0.5
    rewards = [[0.1, 0.2, 0.3, 1.0, 0.0], [0.0, -0.1, 9.0, 0.4, 2.0], [0.5, 0.0, 0.0, 0.0, 0.0]]
    # Row 1 has a masked hole at t=2 (e.g. tool output): as verl 0.9.1, the return is carried through it
    # unchanged (not restarted) and its 9.0 is ignored.
    mask = [[1, 1, 1, 1, 0], [1, 1, 0, 1, 1], [1, 0, 0, 0, 0]]
    mask_b = [[bool(v) for v in row] for row in mask]
    ref_returns = []
    for row, m in zip(rewards, mask_b, strict=True):
        out, running = [0.0] * len(row), 0.0
        for t in reversed(range(len(row))):
            if m[t]:
                running = row[t] + gamma * running
                out[t] = running
        ref_returns.append(out)
    # Hand check of the recursion: row 0 t=0: 0.1 + 0.5 * (0.2 + 0.5 * (0.3 + 0.5 * 1.0)) = 0.4; row 1:
    # t=3: 0.4 + 0.5 * 2 = 1.4, t=1 (t=2 skipped): -0.1 + 0.5 * 1.4 = 0.6, t=0: 0.5 * 0.6 = 0.3.
    assert ref_returns[0][0] == pytest.approx(0.4)
    assert ref_returns[1] == pytest.approx([0.3, 0.6, 0.0, 1.4, 2.0])
    inputs = AdvantageInputs(torch.tensor(rewards), torch.tensor(mask), torch.tensor([0, 0, 1]), gamma=gamma)
    advantages_BT, returns_BT = compute_advantages("reinforce_plus_plus", inputs)
    torch.testing.assert_close(returns_BT, torch.tensor(ref_returns))
    torch.testing.assert_close(advantages_BT, _whiten_ref(ref_returns, mask_b))
    valid_BT = torch.tensor(mask_b)
    assert advantages_BT[valid_BT].mean().abs() < 1e-6
    assert advantages_BT[valid_BT].std().item() == pytest.approx(1.0, abs=1e-4)


def test_reinforce_plus_plus_baseline_group_mean_then_token_whitening():
    advantages_BT, returns_BT = compute_advantages(
        "reinforce_plus_plus_baseline", _outcome(SCORES, LENGTHS, IDS)
    )
    groups = _groups_ref(SCORES, IDS)
    centered = [
        s - (statistics.fmean(groups[g]) if len(groups[g]) > 1 else 0.0)
        for s, g in zip(SCORES, IDS, strict=True)
    ]
    rows = [[c] * 4 for c in centered]
    mask = [[t < n for t in range(4)] for n in LENGTHS]
    torch.testing.assert_close(advantages_BT, _whiten_ref(rows, mask))
    torch.testing.assert_close(returns_BT, advantages_BT)


# ---------------------------------------------------------------------------------------------- remax


def test_remax_subtracts_greedy_baseline_from_reward_to_go():
    rewards = [[0.1, 0.2, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    inputs = AdvantageInputs(
        torch.tensor(rewards),
        torch.tensor(mask),
        torch.tensor([0, 1]),
        baseline_B=torch.tensor([0.4, 1.0]),
        gamma=0.5,  # ignored: ReMax's return is undiscounted in verl
    )
    advantages_BT, returns_BT = compute_advantages("remax", inputs)
    torch.testing.assert_close(returns_BT, torch.tensor([[1.3, 1.2, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))
    torch.testing.assert_close(advantages_BT, torch.tensor([[0.9, 0.8, 0.6, 0.0], [-0.5, -0.5, 0.0, 0.0]]))


# ---------------------------------------------------------------------------------------------- opo


def test_opo_length_weighted_baseline():
    advantages_BT, returns_BT = compute_advantages("opo", _outcome(SCORES, LENGTHS, IDS))
    ref = []
    for s, g in zip(SCORES, IDS, strict=True):
        members = [(SCORES[j], LENGTHS[j]) for j in range(len(SCORES)) if IDS[j] == g]
        b = sum(n * r for r, n in members) / sum(n for _, n in members) if len(members) > 1 else 0.0
        ref.append(s - b)
    torch.testing.assert_close(advantages_BT, _broadcast_ref(ref, LENGTHS, 4))
    torch.testing.assert_close(returns_BT, advantages_BT)
    # By hand: group 3 = scores [0.5, -0.5], lengths [2, 4]: b = (1 - 2) / 6 = -1/6.
    torch.testing.assert_close(advantages_BT[[1, 4], 0], torch.tensor([0.5 + 1 / 6, -0.5 + 1 / 6]))
    assert advantages_BT[3, 0].item() == pytest.approx(0.7)  # group of one: baseline 0


# ---------------------------------------------------------------------------------------------- grpo_passk


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_only_best_sample_gets_advantage(norm: bool):
    scores = [0.2, 1.0, 0.9, 0.5, 0.3, 0.3]
    ids = [5, 2, 5, 5, 2, 2]
    inputs = _outcome(scores, [4, 3, 2, 1, 4, 2], ids, norm_by_std=norm)
    advantages_BT, returns_BT = compute_advantages("grpo_passk", inputs)
    gap5, gap2 = 0.9 - 0.5, 1.0 - 0.3
    if norm:
        gap5 /= statistics.stdev([0.2, 0.9, 0.5]) + 1e-6
        gap2 /= statistics.stdev([1.0, 0.3, 0.3]) + 1e-6
    expected = _broadcast_ref([0.0, gap2, gap5, 0.0, 0.0, 0.0], [4, 3, 2, 1, 4, 2], 4)
    torch.testing.assert_close(advantages_BT, expected)
    torch.testing.assert_close(returns_BT, expected)


def test_grpo_passk_tie_for_best_gives_zero_and_group_of_one_raises():
    advantages_BT, _ = compute_advantages("grpo_passk", _outcome([1.0, 0.0, 1.0], [2, 2, 2], [0, 0, 0]))
    assert (advantages_BT == 0).all()
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        compute_advantages("grpo_passk", _outcome(SCORES, LENGTHS, IDS))


# ---------------------------------------------------------------------------------------------- gpg


def test_gpg_scales_by_batch_over_nonzero_rewards():
    scores = [1.0, 0.0, 0.0, 0.0, 2.0, 0.0]
    ids = [0, 0, 1, 1, 1, 2]
    advantages_BT, returns_BT = compute_advantages("gpg", _outcome(scores, [1] * 6, ids, T=1))
    alpha = 6 / 2  # 6 samples, 2 with a non-zero reward
    # Group means: 0.5, 2/3, and the group of one has mean 0; no std division.
    expected = [alpha * v for v in [0.5, -0.5, -2 / 3, -2 / 3, 4 / 3, 0.0]]
    torch.testing.assert_close(advantages_BT[:, 0], torch.tensor(expected))
    torch.testing.assert_close(returns_BT, advantages_BT)
    # All rewards zero: alpha = B / max(0, 1), advantages 0.
    zero_BT, _ = compute_advantages("gpg", _outcome([0.0, 0.0], [1, 1], [0, 0], T=1))
    assert (zero_BT == 0).all()


# ---------------------------------------------------------------------------------------------- gae


def test_gae_hand_unrolled_one_sequence():
    gamma, lam = 0.9, 0.8
    r, v = [0.0, 0.1, 1.0], [0.5, 0.4, 0.6]
    # Hand-unrolled: the value after the last token is 0.
    d2 = r[2] - v[2]
    d1 = r[1] + gamma * v[2] - v[1]
    d0 = r[0] + gamma * v[1] - v[0]
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    raw = [a0, a1, a2]
    # A second row so the batch-wide whitening has something to mix.
    r2, v2 = [0.0, -1.0, 0.0], [0.2, 0.3, 0.0]
    b1 = r2[1] - v2[1]
    b0 = r2[0] + gamma * v2[1] - v2[0] + gamma * lam * b1
    inputs = AdvantageInputs(
        token_rewards_BT=torch.tensor([r, r2]),
        response_mask_BT=torch.tensor([[1, 1, 1], [1, 1, 0]]),
        group_ids_B=torch.tensor([0, 1]),
        values_BT=torch.tensor([v, v2]),
        gamma=gamma,
        lam=lam,
    )
    advantages_BT, returns_BT = compute_advantages("gae", inputs)
    mask = [[True] * 3, [True, True, False]]
    torch.testing.assert_close(
        returns_BT,
        torch.tensor([[a + x for a, x in zip(raw, v, strict=True)], [b0 + v2[0], b1 + v2[1], 0.0]]),
    )
    torch.testing.assert_close(advantages_BT, _whiten_ref([raw, [b0, b1, 0.0]], mask))


def test_gae_skips_masked_positions_inside_a_response():
    # A loop-based reference over each row's valid positions only (masked ones, e.g. tool output,
    # are skipped: their reward and value do not enter the recursion).
    gamma, lam = 0.95, 0.7
    rewards = [[0.1, 5.0, 0.2, 0.0, 1.0], [0.3, 0.0, 0.0, -0.5, 7.0]]
    values = [[0.4, 9.0, 0.1, 0.3, 0.2], [0.6, 0.5, 0.1, 0.2, 9.0]]
    mask = [[1, 0, 1, 1, 1], [1, 1, 1, 1, 0]]
    raw = []
    for row_r, row_v, row_m in zip(rewards, values, mask, strict=True):
        valid = [t for t in range(5) if row_m[t]]
        out, next_value, next_adv = [0.0] * 5, 0.0, 0.0
        for t in reversed(valid):
            next_adv = row_r[t] + gamma * next_value - row_v[t] + gamma * lam * next_adv
            next_value = row_v[t]
            out[t] = next_adv
        raw.append(out)
    inputs = AdvantageInputs(
        torch.tensor(rewards),
        torch.tensor(mask),
        torch.tensor([0, 0]),
        values_BT=torch.tensor(values),
        gamma=gamma,
        lam=lam,
    )
    advantages_BT, returns_BT = compute_advantages("gae", inputs)
    mask_b = [[bool(x) for x in row] for row in mask]
    expected_returns = [
        [a + v if m else 0.0 for a, v, m in zip(ra, rv, rm, strict=True)]
        for ra, rv, rm in zip(raw, values, mask_b, strict=True)
    ]
    torch.testing.assert_close(returns_BT, torch.tensor(expected_returns))
    torch.testing.assert_close(advantages_BT, _whiten_ref(raw, mask_b))


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = sum_{s >= t} r_s - V_t, so returns = reward-to-go.
    inputs = AdvantageInputs(
        token_rewards_BT=torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]),
        response_mask_BT=torch.tensor([[1, 1, 1], [1, 1, 0]]),
        group_ids_B=torch.tensor([0, 1]),
        values_BT=torch.tensor([[0.3, 0.2, 0.1], [0.5, 0.4, 0.0]]),
    )
    _, returns_BT = compute_advantages("gae", inputs)
    torch.testing.assert_close(returns_BT, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))


def test_whitening_needs_two_valid_tokens():
    inputs = AdvantageInputs(torch.ones(1, 2), torch.tensor([[1, 0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="at least 2 valid tokens"):
        compute_advantages("reinforce_plus_plus", inputs)


# ---------------------------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("name", ["grpo", "rloo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"])
def test_outcome_scores_sum_the_whole_row_so_rejected_tokens_keep_their_reward(name: str):
    # The rollout correction's rejection edits only the mask, before the advantages (verl's order), and
    # verl's scores sum the whole row: a sequence whose last token (which holds the reward) or every token
    # was rejected still counts with its reward in its group's statistics.
    sampled = _outcome([1.0, 0.0, 0.5, 0.2, 0.9, 0.0], [3, 2, 3, 2, 4, 1], [0, 0, 0, 1, 1, 1])
    mask_BT = sampled.response_mask_BT.clone()
    mask_BT[0, 2] = False  # row 0's last token
    mask_BT[2] = False  # all of row 2
    rejected = dataclasses.replace(sampled, response_mask_BT=mask_BT)
    advantages_BT, _ = compute_advantages(name, rejected)
    before_BT, _ = compute_advantages(name, sampled)
    assert (advantages_BT[~mask_BT] == 0).all()
    if name == "reinforce_plus_plus_baseline":  # whitened over the tokens left
        mask = mask_BT.tolist()
        torch.testing.assert_close(advantages_BT, _whiten_ref(before_BT.tolist(), mask))
    else:  # the group statistics did not change: the same advantage on the tokens left
        torch.testing.assert_close(advantages_BT, before_BT * mask_BT)


# ---------------------------------------------------------------------------------------------- vectorized


def test_rloo_vectorized_is_rloo_but_zero_for_a_group_of_one():
    inputs = _outcome(SCORES, LENGTHS, IDS)
    loop_BT, _ = compute_advantages("rloo", inputs)
    vectorized_BT, returns_BT = compute_advantages("rloo_vectorized", inputs)
    alone = torch.tensor(IDS) == 9  # the group of one: raw reward in rloo, 0 here (verl's * (n > 1))
    torch.testing.assert_close(vectorized_BT[~alone], loop_BT[~alone])
    assert (vectorized_BT[alone] == 0).all() and (loop_BT[alone] != 0).any()
    torch.testing.assert_close(returns_BT, vectorized_BT)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_is_grpo_always_divided_by_the_std(norm: bool):
    """verl's trainer never hands grpo_vectorized norm_adv_by_std_in_grpo: it is grpo with the division on."""
    inputs = _outcome(SCORES, LENGTHS, IDS, norm_by_std=norm)
    normed = _outcome(SCORES, LENGTHS, IDS, norm_by_std=True)
    torch.testing.assert_close(
        compute_advantages("grpo_vectorized", inputs)[0], compute_advantages("grpo", normed)[0]
    )


# ---------------------------------------------------------------------------------------------- gdpo


def test_gdpo_normalizes_each_reward_component_in_its_group_then_whitens():
    # Two components per sample; component 0 has a large scale that would drown component 1 in a sum.
    comp = [[10.0, 1.0], [0.0, 0.0], [10.0, 0.0], [3.0, 1.0], [0.0, 1.0], [5.0, 0.0]]
    weights = (1.0, 0.5)
    inputs = _outcome(
        [0.0] * 6,
        LENGTHS,
        IDS,
        reward_components_BK=torch.tensor(comp),
        reward_weights_K=weights,
    )
    per_k = [_grpo_ref([c[k] for c in comp], IDS, norm=True) for k in range(2)]
    total = [sum(w * per_k[k][i] for k, w in enumerate(weights)) for i in range(6)]
    mask = _mask(LENGTHS, 4).tolist()
    expected = _whiten_ref([[a] * 4 for a in total], mask)
    advantages_BT, returns_BT = compute_advantages("gdpo", inputs)
    torch.testing.assert_close(advantages_BT, expected)
    torch.testing.assert_close(returns_BT, advantages_BT)
    # Without components the sequence's score is the one component (verl's fallback): whitened GRPO.
    plain = _outcome(SCORES, LENGTHS, IDS)
    grpo_BT, _ = compute_advantages("grpo", plain)
    torch.testing.assert_close(compute_advantages("gdpo", plain)[0], _whiten_ref(grpo_BT.tolist(), mask))
    with pytest.raises(ValueError, match="3 reward weights for 2 reward components"):
        compute_advantages("gdpo", dataclasses.replace(inputs, reward_weights_K=(1.0, 1.0, 1.0)))
    with pytest.raises(ValueError, match="reward_components_BK must have shape"):
        dataclasses.replace(inputs, reward_components_BK=torch.zeros(5, 2))


# ---------------------------------------------------------------------------------------------- OTB


def _otb_ref(
    rewards: list[list[float]],
    mask: list[list[bool]],
    ids: list[int],
    old: list[list[float]],
    sps: list[list[float]],
    isw: list[list[float]] | None,
    multi_turn: bool,
) -> list[list[float]]:
    """verl's optimal token baseline written out per token: step = column (a group's responses start at
    one column) or, multi-turn, the index among the row's valid tokens."""
    B, T = len(rewards), len(rewards[0])
    rows = []
    for b in range(B):
        cols = [t for t in range(T) if mask[b][t]]
        g_ret = [sum(rewards[b][u] for u in cols if u >= t) for t in cols]
        w = [1 - 2 * math.exp(old[b][t]) + sps[b][t] for t in cols]
        if isw is not None:
            w = [wi * isw[b][t] ** 2 for wi, t in zip(w, cols, strict=True)]
        cum_w = [sum(w[: j + 1]) for j in range(len(cols))]
        step = list(range(len(cols))) if multi_turn else cols
        rows.append({"cols": cols, "G": g_ret, "W": cum_w, "step": step})
    out = [[0.0] * T for _ in range(B)]
    members = {}
    for b, g in enumerate(ids):
        if rows[b]["cols"] or not multi_turn:
            members.setdefault(g, []).append(b)
    for b in range(B):
        r, group = rows[b], members.get(ids[b], [b])
        lengths = sorted(len(rows[i]["cols"]) for i in group)
        unique_longest = len(group) > 1 and lengths[-1] > lengths[-2]
        start = 0 if multi_turn else (r["cols"][0] if r["cols"] else 0)
        for j, t in enumerate(r["cols"]):
            s = r["step"][j]
            baseline = 0.0
            if len(group) > 1:
                num = den = 0.0
                for i in group:
                    if s in rows[i]["step"]:
                        k = rows[i]["step"].index(s)
                        num += rows[i]["G"][k] * rows[i]["W"][k]
                        den += rows[i]["W"][k]
                baseline = num / (den + 1e-8)
                if unique_longest and len(r["cols"]) == lengths[-1] and s >= start + lengths[-2]:
                    baseline = 0.0
            out[b][t] = r["G"][j] - baseline
    return out


def _otb_case(multi_turn: bool) -> tuple[AdvantageInputs, list[list[bool]]]:
    """Group 0 (rows 0-2) answers from column 1, group 1 (rows 3-4) from column 2, row 5 alone. Row 0 is
    its group's single longest (its steps past the second-longest get baseline 0); multi-turn, rows 0
    and 3 have tool output (masked) inside."""
    T = 8
    spans = [(1, 7), (1, 4), (1, 3), (2, 5), (2, 5), (1, 3)]
    mask = [[s <= t < e for t in range(T)] for s, e in spans]
    if multi_turn:
        mask[0][3] = mask[3][3] = False
    g = torch.Generator().manual_seed(0)
    mask_BT = torch.tensor(mask)
    rewards_BT = token_level_rewards(torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 2.0]), mask_BT)
    rewards_BT = rewards_BT + 0.1 * torch.randn(6, T, generator=g) * mask_BT  # per-token terms
    inputs = AdvantageInputs(
        token_rewards_BT=rewards_BT,
        response_mask_BT=mask_BT,
        group_ids_B=torch.tensor([0, 0, 0, 1, 1, 2]),
        old_logprobs_BT=-torch.rand(6, T, generator=g) * 2,
        sum_pi_squared_BT=torch.rand(6, T, generator=g) * 0.5 + 0.2,
        is_weights_BT=torch.rand(6, T, generator=g) + 0.5,
    )
    return inputs, mask


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("with_is", [True, False])
def test_optimal_token_baseline_against_verls_formula(name: str, with_is: bool):
    multi_turn = name.startswith("tir")
    inputs, mask = _otb_case(multi_turn)
    if not with_is:
        inputs = dataclasses.replace(inputs, is_weights_BT=None)
    ref = _otb_ref(
        inputs.token_rewards_BT.tolist(),
        mask,
        inputs.group_ids_B.tolist(),
        inputs.old_logprobs_BT.tolist(),
        inputs.sum_pi_squared_BT.tolist(),
        inputs.is_weights_BT.tolist() if with_is else None,
        multi_turn,
    )
    advantages_BT, returns_BT = compute_advantages(name, inputs)
    torch.testing.assert_close(advantages_BT, torch.tensor(ref))
    # Returns: the reward-to-go over the valid tokens; the lone row 5's advantage is its return.
    rewards = torch.where(inputs.response_mask_BT, inputs.token_rewards_BT, 0.0)
    torch.testing.assert_close(returns_BT, rewards.flip(1).cumsum(1).flip(1) * inputs.response_mask_BT)
    torch.testing.assert_close(advantages_BT[5], returns_BT[5])


def test_tir_steps_are_valid_tokens_not_columns():
    # With tool output inside a response the two estimators compare different tokens across samples.
    inputs, _ = _otb_case(multi_turn=True)
    otb_BT, _ = compute_advantages("optimal_token_baseline", inputs)
    tir_BT, _ = compute_advantages("tir_optimal_token_baseline", inputs)
    assert not torch.allclose(otb_BT[:3], tir_BT[:3])
    # Without holes they agree.
    plain, _ = _otb_case(multi_turn=False)
    torch.testing.assert_close(
        compute_advantages("optimal_token_baseline", plain)[0],
        compute_advantages("tir_optimal_token_baseline", plain)[0],
    )


def test_optimal_token_baseline_needs_the_old_policy_statistics():
    inputs = _outcome(SCORES, LENGTHS, IDS)
    with pytest.raises(ValueError, match="sum_pi_squared_BT"):
        compute_advantages("optimal_token_baseline", inputs)
    with pytest.raises(ValueError, match="old_logprobs_BT must have shape"):
        dataclasses.replace(inputs, old_logprobs_BT=torch.zeros(6, 3))
