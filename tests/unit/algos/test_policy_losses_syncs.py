"""clip_cov, kl_cov, sapo and bypass_mode's rollout correction without host-device syncs, and their results
unchanged.

The update calls a policy loss once per micro-batch, so a read of a device value there (``int(t)``, a
boolean index) or a blocking host -> device copy stops a GPU's queue once per micro-batch. kl_cov and
clip_cov take the micro-batch's valid-token count from the host (``num_valid_tokens``), kl_cov gathers
its valid tokens without a boolean index, sapo fills its temperatures on the device, and the rollout
correction picks its ``rollout_is_std`` on the device. The ``_reference_*`` functions below are the
bodies these losses had before, kept to check that every loss, gradient and metric is bitwise the same,
and that clip_cov draws the same tokens from the same seed (and leaves the global RNG where it did).
spmdrl.testing.syncs.SyncCounter counts the syncs on CPU; tests/integration/test_update_syncs_losses.py
counts them in the update itself.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmdrl.algos.aggregation import Aggregation, count_units, masked_mean
from spmdrl.algos.correction import rollout_correction
from spmdrl.algos.policy_losses import (
    POLICY_LOSSES,
    PolicyLossOutput,
    as_token_advantages,
    register_policy_loss,
)
from spmdrl.config import AlgorithmConfig, RolloutCorrectionConfig
from spmdrl.testing.syncs import SyncCounter

PARAMS = AlgorithmConfig(
    clip_cov_ratio=0.2, clip_cov_lb=-2.0, clip_cov_ub=5.0, kl_cov_ratio=0.2, tau_pos=1.0, tau_neg=1.05
)


# ---------------------------------------------------------------------------------------------- references


def _reference_clip_cov(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT):
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    valid_BT = mask_BT.bool()
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    with torch.no_grad():
        clipped_by_ppo_BT = (clipped_BT > unclipped_BT) & valid_BT
        cov_BT = (advantages_BT - masked_mean(advantages_BT, mask_BT)) * (
            logprobs_BT - masked_mean(logprobs_BT, mask_BT)
        )
        candidates_BT = (
            (cov_BT > params.clip_cov_lb) & (cov_BT < params.clip_cov_ub) & valid_BT & ~clipped_by_ppo_BT
        )
        candidate_idx_N2 = torch.nonzero(candidates_BT)
        n_draw = max(int(params.clip_cov_ratio * int(valid_BT.sum())), 1)
        drawn_BT = torch.zeros_like(valid_BT)
        if len(candidate_idx_N2) > 0:
            perm_N = torch.randperm(len(candidate_idx_N2))[:n_draw].to(candidate_idx_N2.device)
            chosen_K2 = candidate_idx_N2[perm_N]
            drawn_BT[chosen_K2[:, 0], chosen_K2[:, 1]] = True
    loss_BT = torch.where(drawn_BT, 0.0, torch.maximum(unclipped_BT, clipped_BT))
    loss = agg(loss_BT if is_weights_BT is None else loss_BT * is_weights_BT.detach(), mask_BT)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(drawn_BT.float(), mask_BT).detach().float(),
            "ppo_kl": masked_mean(-log_ratio_BT, mask_BT).detach().float(),
        }
    return PolicyLossOutput(loss, metrics)


def _reference_kl_cov(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT):
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    valid_BT = mask_BT.bool()
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    ratio_BT = torch.exp(log_ratio_BT)
    pg_BT = -advantages_BT * ratio_BT
    with torch.no_grad():
        selected_BT = torch.zeros_like(valid_BT)
        n_valid = int(valid_BT.sum())
        if n_valid > 0:
            adv_N = advantages_BT[valid_BT].detach()
            logp_N = logprobs_BT[valid_BT].detach()
            cov_N = (adv_N - adv_N.mean()) * (logp_N - logp_N.mean())
            top_K = torch.topk(cov_N, max(1, int(n_valid * params.kl_cov_ratio)), largest=True).indices
            selected_N = torch.zeros_like(cov_N, dtype=torch.bool)
            selected_N[top_K] = True
            selected_BT[valid_BT] = selected_N
    loss_BT = torch.where(selected_BT, pg_BT + params.ppo_kl_coef * log_ratio_BT.abs(), pg_BT)
    loss = agg(loss_BT if is_weights_BT is None else loss_BT * is_weights_BT.detach(), mask_BT)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(log_ratio_BT.abs(), mask_BT).detach().float()}
    return PolicyLossOutput(loss, metrics)


def _reference_sapo(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT):
    advantages_BT = as_token_advantages(advantages_BT, logprobs_BT)
    log_ratio_BT = (logprobs_BT - old_logprobs_BT).clamp(-20.0, 20.0)
    ratio_BT = torch.exp(log_ratio_BT)
    tau_BT = torch.where(
        advantages_BT > 0,
        torch.tensor(params.tau_pos, dtype=ratio_BT.dtype, device=ratio_BT.device),
        torch.tensor(params.tau_neg, dtype=ratio_BT.dtype, device=ratio_BT.device),
    )
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)
    loss_BT = -gate_BT * advantages_BT
    loss = agg(loss_BT if is_weights_BT is None else loss_BT * is_weights_BT.detach(), mask_BT)
    zero = torch.zeros((), dtype=torch.float32)
    metrics = {
        "pg_clipfrac": zero,
        "ppo_kl": masked_mean(-log_ratio_BT, mask_BT).detach().float(),
        "pg_clipfrac_lower": zero,
    }
    return PolicyLossOutput(loss, metrics)


REFERENCES = {"clip_cov": _reference_clip_cov, "kl_cov": _reference_kl_cov, "sapo": _reference_sapo}


# ---------------------------------------------------------------------------------------------- batches


@dataclasses.dataclass
class Case:
    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    is_w: torch.Tensor | None


def _case(seed: int, dtype: torch.dtype, *, seq_adv: bool, with_is: bool, empty: bool = False) -> Case:
    """Random rows with a row of no valid token, a long (not bool) mask, per-sequence or per-token
    advantages (per-sequence ones make many equal covariances: topk's ties)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 11
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[2] = 0
    if empty:
        mask.zero_()
    old = -(3 * torch.rand(B, T, generator=g, dtype=dtype) + 0.05)
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype) if seq_adv else torch.randn(B, T, generator=g, dtype=dtype)
    is_w = 0.5 + torch.rand(B, T, generator=g, dtype=dtype) if with_is else None
    return Case(logp, old, adv, mask, is_w)


CASES = {
    "f32-token": dict(seed=0, dtype=torch.float32, seq_adv=False, with_is=False),
    "f32-seq-is": dict(seed=1, dtype=torch.float32, seq_adv=True, with_is=True),
    "f64-token-is": dict(seed=2, dtype=torch.float64, seq_adv=False, with_is=True),
    "f64-seq": dict(seed=3, dtype=torch.float64, seq_adv=True, with_is=False),
    "no-valid-token": dict(seed=4, dtype=torch.float32, seq_adv=False, with_is=False, empty=True),
}


def _run(fn, c: Case, **kwargs) -> tuple[PolicyLossOutput, torch.Tensor, torch.Tensor]:
    """(output, the gradient of the logprobs, the global RNG's next draw after the call)."""
    logp = c.logp.clone().requires_grad_(True)
    agg = Aggregation("token-mean", count_units(c.mask, "token-mean"))
    torch.manual_seed(123)
    out = fn(logp, c.old, c.adv, c.mask, agg=agg, params=PARAMS, is_weights_BT=c.is_w, **kwargs)
    after = torch.randint(0, 2**31, (4,))
    out.loss.backward()
    grad = logp.grad if logp.grad is not None else torch.zeros_like(logp)
    return out, grad, after


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "sapo"])
@pytest.mark.parametrize("host_count", [True, False])
def test_results_bitwise_as_before(name: str, case: str, host_count: bool) -> None:
    c = _case(**CASES[case])
    kwargs = {}
    if POLICY_LOSSES.get(name).valid_count:
        kwargs["num_valid_tokens"] = int(c.mask.sum()) if host_count else None
    ours, ours_grad, ours_rng = _run(POLICY_LOSSES[name], c, **kwargs)
    ref, ref_grad, ref_rng = _run(REFERENCES[name], c)
    assert ours.loss.dtype == ref.loss.dtype and torch.equal(ours.loss, ref.loss)
    assert torch.equal(ours_grad, ref_grad)
    assert ours.metrics.keys() == ref.metrics.keys()
    for k in ours.metrics:
        assert torch.equal(ours.metrics[k], ref.metrics[k]), k
    assert torch.equal(ours_rng, ref_rng)  # clip_cov's draw took as many numbers from the global RNG


def test_clip_cov_and_kl_cov_select_tokens() -> None:
    """The comparison above would be empty if nothing were drawn / selected: on these batches both
    losses change the loss of some tokens (clip_cov's pg_clipfrac > 0, kl_cov's loss != plain PG)."""
    c = _case(**CASES["f32-token"])
    out, _, _ = _run(POLICY_LOSSES["clip_cov"], c, num_valid_tokens=int(c.mask.sum()))
    assert out.metrics["pg_clipfrac"] > 0
    kl = _run(POLICY_LOSSES["kl_cov"], c, num_valid_tokens=int(c.mask.sum()))[0].loss
    plain = dataclasses.replace(PARAMS, ppo_kl_coef=0.0)
    agg = Aggregation("token-mean", count_units(c.mask, "token-mean"))
    pg = POLICY_LOSSES["kl_cov"](c.logp, c.old, c.adv, c.mask, agg=agg, params=plain).loss
    assert kl > pg


# ---------------------------------------------------------------------------------------------- syncs


def _syncs(name: str, c: Case, params: AlgorithmConfig = PARAMS, **kwargs) -> SyncCounter:
    logp = c.logp.clone().requires_grad_(True)
    agg = Aggregation("token-mean", count_units(c.mask, "token-mean"))
    with SyncCounter() as counter:
        out = POLICY_LOSSES[name](logp, c.old, c.adv, c.mask, agg=agg, params=params, **kwargs)
        out.loss.backward()
    return counter


@pytest.mark.parametrize("case", ["f32-token", "f64-seq", "no-valid-token"])
def test_no_sync_with_the_host_count(case: str) -> None:
    c = _case(**CASES[case])
    n = int(c.mask.sum())
    for name in ("kl_cov", "sapo"):
        kwargs = {"num_valid_tokens": n} if name == "kl_cov" else {}
        counter = _syncs(name, c, **kwargs)
        assert counter.count() == 0, f"{name}:\n{counter.summary()}"
    # clip_cov's one read: its candidates (randperm draws on the host, as verl's, for verl's draw).
    counter = _syncs("clip_cov", c, num_valid_tokens=n)
    assert [e.kind for e in counter.events] == ["nonzero"], counter.summary()
    # Without the host count the losses still work, and read it.
    assert _syncs("kl_cov", c).count("item") == 1


def test_bypass_mode_rollout_correction_has_no_sync() -> None:
    """bypass_mode runs the rollout correction per micro-batch; its rollout_is_std no longer reads the
    valid count (and is still the std, or 0 with at most one valid token)."""
    c = _case(**CASES["f32-token"])
    for rollout_is in ("token", "sequence"):
        corr = RolloutCorrectionConfig(
            rollout_is=rollout_is, rollout_is_threshold="2.0", rollout_rs="token_k1",
            rollout_rs_threshold="0.8_1.25", bypass_mode=True,
        )  # fmt: skip
        counter = _syncs("bypass_mode", c, AlgorithmConfig(rollout_correction=corr))
        assert counter.count() == 0, counter.summary()
    for n_valid in (0, 1, 2, int(c.mask.sum())):
        mask = torch.zeros_like(c.mask)
        mask.view(-1)[torch.nonzero(c.mask.view(-1)).squeeze(1)[:n_valid]] = 1
        out = rollout_correction(
            c.logp, c.old, mask, rollout_is="token", rollout_is_threshold="2.0",
            rollout_is_batch_normalize=False, rollout_rs=None, rollout_rs_threshold=None,
        )  # fmt: skip
        valid = mask.bool()
        w = torch.exp((c.logp - c.old).clamp(-20, 20)).clamp(max=2.0)
        std = (masked_mean(w.square(), valid) - masked_mean(w, valid).square()).clamp_min(0).sqrt()
        expected = std if n_valid > 1 else torch.zeros(())
        assert torch.equal(out.metrics["rollout_is_std"], expected.float()), n_valid


# ---------------------------------------------------------------------------------------------- registry


def test_valid_count_is_declared() -> None:
    assert POLICY_LOSSES.get("clip_cov").valid_count and POLICY_LOSSES.get("kl_cov").valid_count
    assert not POLICY_LOSSES.get("vanilla").valid_count
    assert POLICY_LOSSES.get("kl_cov").extra_kwargs() == ("num_valid_tokens",)

    def no_count(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT=None):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="num_valid_tokens"):
        register_policy_loss("test_no_count", valid_count=True)(no_count)
    assert "test_no_count" not in POLICY_LOSSES
