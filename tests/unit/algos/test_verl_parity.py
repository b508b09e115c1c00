"""Parity with verl 0.9.1: verl's own functions and spmdrl's, on the same random inputs, for every name verl
accepts (verl is imported from its released wheel by :mod:`spmdrl.testing.verl_reference`).

Each case returns its differences by component (loss, gradient, each metric, ...). The difference of two
numbers is ``|spmdrl - verl| / max(1, |verl|)``: absolute up to 1, relative above (importance weights reach
e^20); it must be at most ``TOL``. Inputs are float64, so verl's side is exact to ~1e-16 and spmdrl's
float32 casts show as ~1e-7. A name verl accepts and spmdrl does not fails with "spmdrl has no ...".
verl's side is its trainer's path: ``ray_trainer.compute_advantage`` for the estimators, the losses with
the ``global_batch_info`` its trainer sets; where spmdrl reaches verl's result through a switch
(``agg_mode_for``, ``count_units(count_empty_rows=True)``, ``AdvantageInputs.batch_sum``), the case sets
it. "2 ranks" cases run spmdrl on a real two-process gloo group, each rank on its shard of whole groups.

The table for docs/algorithms.md ("Parity with verl 0.9.1")::

    .venv/bin/python tests/unit/algos/test_verl_parity.py --table
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from spmdrl.algos import advantages as adv_mod
from spmdrl.algos.aggregation import AGG_MODES, Aggregation, count_units
from spmdrl.algos.correction import (
    metric_reduction,
    rollout_correction,
    rollout_is_weights,
    rollout_rejection_mask,
)
from spmdrl.algos.dapo import groups_with_signal, overlong_penalty
from spmdrl.algos.kl import KL_ESTIMATORS, kl_penalty
from spmdrl.algos.kl_control import apply_kl_penalty, build_kl_controller
from spmdrl.algos.losses import entropy_from_logits, token_logprobs
from spmdrl.algos.policy_losses import POLICY_LOSSES, agg_mode_for
from spmdrl.algos.value_loss import clipped_value_loss
from spmdrl.config import AlgorithmConfig, RolloutCorrectionConfig
from spmdrl.distributed.reduce import all_reduce_sum, sum_over_group
from spmdrl.testing import verl_reference
from spmdrl.testing.spawn import run_distributed
from spmdrl.testing.verl_reference import DataProto, VerlReference

pytestmark = pytest.mark.guarantee("verl:parity")

TOL = 1e-5
Diffs = dict[str, float]

# verl 0.9.1's names (test_names_are_verls checks them against the wheel's registries).
VERL_ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "rloo_vectorized",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
)
VERL_POLICY_LOSSES = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
)
VERL_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# core_algos.kl_penalty_forward's names, each also with verl's straight-through "+" ("full" raises there).
VERL_KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
VERL_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


class NotInSpmdrl(AssertionError):
    """A name verl accepts that spmdrl does not (yet)."""


# ---------------------------------------------------------------------------------------------- comparing


def _diff(ours: Any, theirs: Any) -> float:
    """max |ours - theirs| / max(1, |theirs|); NaN where both are NaN (or the same infinity) counts as equal."""
    a = torch.as_tensor(ours.detach() if isinstance(ours, torch.Tensor) else ours).to(torch.float64)
    b = torch.as_tensor(theirs.detach() if isinstance(theirs, torch.Tensor) else theirs).to(torch.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: spmdrl {tuple(a.shape)}, verl {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    equal = (a.isnan() & b.isnan()) | (a.isinf() & (a == b))
    err = torch.where(equal, 0.0, (a - b).abs() / b.abs().clamp_min(1.0))
    return float(torch.where(err.isnan(), math.inf, err).max())


def _metric_diffs(ours: Mapping[str, Any], theirs: Mapping[str, Any], both_ways: bool) -> Diffs:
    """Each of spmdrl's metrics against verl's of the same name (and, ``both_ways``, the reverse)."""
    out = {}
    for k, v in ours.items():
        if k in theirs:
            out[f"metric {k}"] = _diff(v, theirs[k])
        else:
            out[f"metric {k} (not in verl)"] = math.inf
    if both_ways:
        out.update({f"metric {k} (not in spmdrl)": math.inf for k in theirs if k not in ours})
    return out


def _strip(metrics: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k.removeprefix(prefix): v for k, v in metrics.items()}


def _mask(lengths: tuple[int, ...], T: int, gaps: Mapping[int, tuple[int, int]]) -> torch.Tensor:
    """Long (B, T): row b valid on [0, lengths[b]) except an interior span gaps[b] = [lo, hi) (tool output)."""
    pos = torch.arange(T)
    mask = pos < torch.tensor(lengths).unsqueeze(1)
    for b, (lo, hi) in gaps.items():
        mask[b, lo:hi] = False
    return mask.long()


# ---------------------------------------------------------------------------------------------- advantages

GAMMA, LAM = 0.95, 0.9
GROUP_SIZES = (4, 3, 1, 2, 2)  # uneven, one singleton
RANK_GROUPS = ((0, 1, 2), (3, 4))  # "two ranks": whole groups each, 8 and 4 rows
_OTB = ("optimal_token_baseline", "tir_optimal_token_baseline")
GDPO_KEYS, GDPO_WEIGHTS = ("accuracy", "format"), (1.0, 0.5)


@dataclass(frozen=True)
class AdvBatch:
    token_rewards_BT: torch.Tensor  # outcome at the last valid token + small per-token terms on some rows
    mask_BT: torch.Tensor  # long, with interior masked spans
    group_B: torch.Tensor  # long group ids (spmdrl)
    uids: np.ndarray  # the same groups as verl's uid strings
    values_BT: torch.Tensor
    baselines_B: torch.Tensor
    old_logprobs_BT: torch.Tensor
    sum_pi_squared_BT: torch.Tensor
    components_BK: torch.Tensor  # gdpo's reward components (verl: non_tensor_batch[gdpo_reward_keys])


def _adv_batch() -> AdvBatch:
    g = torch.Generator().manual_seed(0)
    lengths = (8, 5, 3, 8, 6, 2, 7, 8, 4, 8, 1, 6)
    B, T = len(lengths), 8
    mask = _mask(lengths, T, {1: (1, 3), 4: (2, 4), 9: (3, 6)})
    # Zeros, spread so that each rank's share of them differs from the batch's (GPG's scale), and a
    # group of equal rewards (std 0, a tie for pass@k).
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.7, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    dense = 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    dense[[1, 3, 5, 7, 9, 10, 11]] = 0.0  # per-token terms (a KL penalty) on some rows only
    last = (mask * torch.arange(T)).argmax(dim=1)
    rewards = dense.clone()
    rewards[torch.arange(B), last] += scores
    group = torch.repeat_interleave(torch.arange(len(GROUP_SIZES)), torch.tensor(GROUP_SIZES))
    logp = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    return AdvBatch(
        token_rewards_BT=rewards,
        mask_BT=mask,
        group_B=group,
        uids=np.array([f"uid{int(i)}" for i in group], dtype=object),
        values_BT=torch.randn(B, T, generator=g, dtype=torch.float64),
        baselines_B=torch.rand(B, generator=g, dtype=torch.float64),
        old_logprobs_BT=logp,
        sum_pi_squared_BT=logp.exp().square() + 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64),
        components_BK=torch.stack([scores, (torch.rand(B, generator=g) < 0.5).double()], dim=1),
    )


def _adv_rows(name: str, groups: tuple[int, ...] | None = None) -> torch.Tensor:
    """The rows of ``groups`` (all by default); grpo_passk drops singleton groups, which both sides refuse."""
    b = _adv_batch()
    keep = torch.ones(len(b.group_B), dtype=torch.bool)
    if groups is not None:
        keep &= torch.isin(b.group_B, torch.tensor(groups))
    if name == "grpo_passk":
        keep &= torch.tensor(GROUP_SIZES)[b.group_B] > 1
    return torch.nonzero(keep).flatten()


def _check_estimator(name: str) -> None:
    if name not in adv_mod.ADV_ESTIMATORS:
        raise NotInSpmdrl(f"spmdrl has no advantage estimator {name!r}")


def _spmdrl_advantages(
    name: str, rows: torch.Tensor, norm_by_std: bool, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """spmdrl on ``rows``; with ``group``, these rows are this rank's shard of the batch."""
    _check_estimator(name)
    b = _adv_batch()
    inputs = adv_mod.AdvantageInputs(
        token_rewards_BT=b.token_rewards_BT[rows],
        response_mask_BT=b.mask_BT[rows],
        group_ids_B=b.group_B[rows],
        values_BT=b.values_BT[rows],
        baseline_B=b.baselines_B[rows],
        batch_sum=None if group is None else sum_over_group(group),
        old_logprobs_BT=b.old_logprobs_BT[rows],
        sum_pi_squared_BT=b.sum_pi_squared_BT[rows],
        reward_components_BK=b.components_BK[rows],
        reward_weights_K=GDPO_WEIGHTS,
        gamma=GAMMA,
        lam=LAM,
        norm_by_std=norm_by_std,
    )
    return adv_mod.compute_advantages(name, inputs)


def _verl_advantages(
    ref: VerlReference, name: str, rows: torch.Tensor, norm_by_std: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's trainer entry point, ray_trainer.compute_advantage, as its fit loop calls it."""
    b = _adv_batch()
    tensors = {"token_level_rewards": b.token_rewards_BT[rows], "response_mask": b.mask_BT[rows]}
    if name == "gae":
        tensors["values"] = b.values_BT[rows]
    if name == "remax":
        tensors["reward_baselines"] = b.baselines_B[rows]
    if name in _OTB:
        tensors["old_log_probs"] = b.old_logprobs_BT[rows]
        tensors["sum_pi_squared"] = b.sum_pi_squared_BT[rows]
    non_tensors = {"uid": b.uids[rows.numpy()]}
    if name == "gdpo":
        # verl's GDPO reads each component from non_tensor_batch and puts it at the response's last
        # token, found from the attention mask (1 over the whole response, tool output included).
        prompt_len, lengths = 2, (b.mask_BT * torch.arange(1, b.mask_BT.shape[1] + 1)).amax(dim=1)[rows]
        response = torch.arange(b.mask_BT.shape[1]) < lengths.unsqueeze(1)
        tensors["prompts"] = torch.zeros(len(rows), prompt_len, dtype=torch.long)
        tensors["attention_mask"] = torch.cat([torch.ones(len(rows), prompt_len), response], 1).long()
        for k, key in enumerate(GDPO_KEYS):
            non_tensors[key] = b.components_BK[rows, k].numpy()
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    config = ref.algorithm_config.AlgoConfig(
        gamma=GAMMA,
        lam=LAM,
        adv_estimator=name,
        norm_adv_by_std_in_grpo=norm_by_std,
        gdpo_reward_keys=list(GDPO_KEYS),
        gdpo_reward_weights=list(GDPO_WEIGHTS),
    )
    out = ref.ray_trainer["compute_advantage"](
        data,
        adv_estimator=name,
        gamma=GAMMA,
        lam=LAM,
        num_repeat=1,
        norm_adv_by_std_in_grpo=norm_by_std,
        config=config,
    )
    return out.batch["advantages"], out.batch["returns"]


def _compare_advantages(
    ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
) -> Diffs:
    # On valid tokens: verl leaves some masked positions non-zero (whitened GAE, RF++ and ReMax returns).
    return {
        "advantages": _diff(ours[0] * mask, theirs[0] * mask),
        "returns": _diff(ours[1] * mask, theirs[1] * mask),
    }


def _advantage_case(name: str, norm_by_std: bool, ref: VerlReference) -> Diffs:
    _check_estimator(name)
    rows = _adv_rows(name)
    ours = _spmdrl_advantages(name, rows, norm_by_std)
    return _compare_advantages(
        ours, _verl_advantages(ref, name, rows, norm_by_std), _adv_batch().mask_BT[rows]
    )


def _advantage_ranks_case(name: str, ref: VerlReference) -> Diffs:
    _check_estimator(name)
    per_rank = _two_rank_results()
    parts = [r["advantages"][name] for r in per_rank]
    for part in parts:
        if isinstance(part, str):
            raise AssertionError(f"spmdrl raised on a rank: {part}")
    ours = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    rows = torch.cat([_adv_rows(name, groups) for groups in RANK_GROUPS])
    return _compare_advantages(ours, _verl_advantages(ref, name, rows, True), _adv_batch().mask_BT[rows])


# ---------------------------------------------------------------------------------------------- aggregation

AGG_T = 6
# Per rank, its micro-batches' rows of one mini-batch of 8 sequences.
AGG_MICRO_BATCHES = (((0, 1, 2), (3,)), ((4, 5), (6, 7)))


def _agg_batch(fully_masked_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = _mask((6, 3, 5, 1, 6, 4, 2, 6), AGG_T, {0: (1, 3), 7: (2, 5)})
    if fully_masked_row:
        mask[5] = 0  # e.g. a sequence rejected whole by rollout correction
    return torch.randn(8, AGG_T, generator=g, dtype=torch.float64), mask


def _spmdrl_rank_aggregation(rank: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """This rank's (sum of its micro-batch losses, their gradient) per (variant, mode, norm)."""
    out: dict[str, Any] = {}
    for fully_masked_row in (False, True):
        loss_BT, mask_BT = _agg_batch(fully_masked_row)
        micro = [torch.tensor(rows) for rows in AGG_MICRO_BATCHES[rank]]
        rank_rows = torch.cat(micro)
        for mode in AGG_MODES:
            for norm in ("explicit", "default"):
                leaf = loss_BT[rank_rows].clone().requires_grad_(True)
                # verl's trainer divides the seq-mean modes by the mini-batch's rows, empty or not.
                local = sum(count_units(mask_BT[rows], mode, count_empty_rows=True) for rows in micro)
                global_count = all_reduce_sum({"n": local}, torch.device("cpu"), group)["n"]
                kwargs = {"norm_length": float(AGG_T)} if norm == "explicit" else {}
                agg = Aggregation(mode, global_count, **kwargs)
                total, start = torch.zeros((), dtype=torch.float64), 0
                for rows in micro:
                    total = total + agg(leaf[start : start + len(rows)], mask_BT[rows])
                    start += len(rows)
                total.backward()
                out[f"{fully_masked_row}/{mode}/{norm}"] = (total.detach(), leaf.grad)
    return out


def _verl_aggregation(
    ref: VerlReference, mode: str, fully_masked_row: bool, loss_scale_factor: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's FSDP path: each micro-batch's agg_loss with the mini-batch's global_batch_info, gradients
    summed over micro-batches and averaged over the dp ranks."""
    loss_BT, mask_BT = _agg_batch(fully_masked_row)
    leaf = loss_BT.clone().requires_grad_(True)
    dp = len(AGG_MICRO_BATCHES)
    info = {
        "dp_size": dp,
        "batch_num_tokens": int(mask_BT.sum()),
        "global_batch_size": mask_BT.shape[0],  # ppo_mini_batch_size * rollout.n: rows, valid or not
        "loss_scale_factor": loss_scale_factor,
    }
    total = torch.zeros((), dtype=torch.float64)
    for micro in AGG_MICRO_BATCHES:
        for rows in micro:
            idx = torch.tensor(rows)
            total = total + ref.core_algos.agg_loss(leaf[idx], mask_BT[idx].bool(), mode, **info) / dp
    total.backward()
    return total.detach(), leaf.grad


def _aggregation_case(mode: str, fully_masked_row: bool, norm: str, ref: VerlReference) -> Diffs:
    if mode not in AGG_MODES:
        raise NotInSpmdrl(f"spmdrl has no loss_agg_mode {mode!r}")
    per_rank = [r["aggregation"][f"{fully_masked_row}/{mode}/{norm}"] for r in _two_rank_results()]
    total = sum(p[0] for p in per_rank)
    grad = torch.cat([p[1] for p in per_rank])
    scale = AGG_T if norm == "explicit" else None
    theirs_total, theirs_grad = _verl_aggregation(ref, mode, fully_masked_row, scale)
    return {"loss": _diff(total, theirs_total), "grad": _diff(grad, theirs_grad)}


# ---------------------------------------------------------------------------------------------- two ranks


def _rank_worker(rank: int, world_size: int) -> dict[str, Any]:
    """spmdrl on one rank's shard: every estimator it has, and every aggregation mode's mini-batch loss."""
    del world_size
    group = dist.group.WORLD
    advantages: dict[str, Any] = {}
    for name in adv_mod.ADV_ESTIMATORS:
        try:
            advantages[name] = _spmdrl_advantages(name, _adv_rows(name, RANK_GROUPS[rank]), True, group)
        except Exception as exc:  # noqa: BLE001 - reported by that estimator's case
            advantages[name] = f"{type(exc).__name__}: {exc}"
    return {"advantages": advantages, "aggregation": _spmdrl_rank_aggregation(rank, group)}


@functools.cache
def _two_rank_results() -> list[dict[str, Any]]:
    return run_distributed(_rank_worker, len(RANK_GROUPS), timeout_s=120)


# ---------------------------------------------------------------------------------------------- policy losses

PG_T = 7
PG_PARAMS = {
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
    "clip_cov_ratio": 0.2,
    "clip_cov_lb": 0.05,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.2,
    "ppo_kl_coef": 0.1,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "dro_beta": 0.1,
}


def _pg_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    # Row 3 has no valid token (a sequence the rollout correction rejected whole).
    mask = _mask((7, 4, 6, 0, 7, 5), PG_T, {0: (2, 4), 4: (1, 2)}).bool()
    old = -(3 * torch.rand(6, PG_T, generator=g, dtype=torch.float64) + 0.05)
    delta = 0.3 * torch.randn(6, PG_T, generator=g, dtype=torch.float64)
    delta[0, 1], delta[2, 3], delta[4, 5], delta[5, 0] = 2.5, -2.5, 1.2, -0.9  # clip, dual-clip
    return {
        "old": old,
        "logp": old + delta,
        "adv": torch.randn(6, PG_T, generator=g, dtype=torch.float64),
        "mask": mask,
        "is_w": 0.5 + 1.5 * torch.rand(6, PG_T, generator=g, dtype=torch.float64),
    }


# bypass_mode's rollout correction (verl: actor.policy_loss.rollout_correction), inside the loss.
BYPASS_CORRECTION = {
    "rollout_is": "token",
    "rollout_is_threshold": 2.0,
    "rollout_rs": "token_k1",
    "rollout_rs_threshold": "0.8_1.25",
}


def _trainer_aggregation(mode: str, mask: torch.Tensor) -> tuple[Aggregation, dict[str, Any]]:
    """One micro-batch that is the whole mini-batch on one rank, as verl's trainer reduces it: spmdrl's
    Aggregation, and verl's global_batch_info (the mini-batch's tokens and rows, empty rows included;
    no loss_scale_factor, so seq-mean-token-sum-norm divides by the mask's width)."""
    agg = Aggregation(mode, count_units(mask, mode, count_empty_rows=True))
    info = {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0]}
    return agg, {**info, "loss_scale_factor": None}


def _policy_loss_case(name: str, mode: str, with_is: bool, loss_type: str, ref: VerlReference) -> Diffs:
    if name not in POLICY_LOSSES:
        raise NotInSpmdrl(f"spmdrl has no policy loss {name!r}")
    b = _pg_batch()
    is_w = b["is_w"] if with_is else None
    # The losses' params: the algorithm section, as the recipe passes it.
    correction = RolloutCorrectionConfig(**BYPASS_CORRECTION, loss_type=loss_type)
    params = AlgorithmConfig(**PG_PARAMS, rollout_correction=correction)
    agg, info = _trainer_aggregation(agg_mode_for(name, mode), b["mask"])
    ours_lp = b["logp"].clone().requires_grad_(True)
    torch.manual_seed(0)  # clip_cov draws its tokens with the global RNG, as verl
    ours = POLICY_LOSSES[name](
        ours_lp, b["old"], b["adv"], b["mask"], agg=agg, params=params, is_weights_BT=is_w
    )
    ours.loss.backward()

    ac = ref.actor_config
    policy = {
        k: v for k, v in PG_PARAMS.items() if k in {f.name for f in dataclasses.fields(ac.PolicyLossConfig)}
    }
    verl_correction = ref.algorithm_config.RolloutCorrectionConfig(**BYPASS_CORRECTION, loss_type=loss_type)
    config = ac.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=PG_PARAMS["clip_ratio_low"],
        clip_ratio_low=PG_PARAMS["clip_ratio_low"],
        clip_ratio_high=PG_PARAMS["clip_ratio_high"],
        clip_ratio_c=PG_PARAMS["clip_ratio_c"],
        tau_pos=PG_PARAMS["tau_pos"],
        tau_neg=PG_PARAMS["tau_neg"],
        loss_agg_mode=mode,
        policy_loss=ac.PolicyLossConfig(loss_mode=name, rollout_correction=verl_correction, **policy),
        global_batch_info=info,
    )
    theirs_lp = b["logp"].clone().requires_grad_(True)
    torch.manual_seed(0)
    theirs_loss, theirs_metrics = ref.core_algos.get_policy_loss_fn(name)(
        old_log_prob=b["old"],
        log_prob=theirs_lp,
        advantages=b["adv"],
        response_mask=b["mask"],
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=is_w,
    )
    theirs_loss.backward()
    theirs_metrics = _strip(theirs_metrics, "actor/")
    # The loss's own metrics both ways; bypass_mode's rollout-correction ones as spmdrl emits them (verl
    # adds off-policy diagnostics that spmdrl computes elsewhere, spmdrl.rollout.mismatch).
    corr = {k: v for k, v in theirs_metrics.items() if k.startswith("rollout_corr/")}
    own = {k: v for k, v in theirs_metrics.items() if k not in corr}
    ours_corr = {k: v for k, v in ours.metrics.items() if k.startswith("rollout_corr/")}
    ours_own = {k: v for k, v in ours.metrics.items() if k not in ours_corr}
    return {
        "loss": _diff(ours.loss, theirs_loss),
        "grad": _diff(ours_lp.grad, theirs_lp.grad),
        **_metric_diffs(ours_own, own, both_ways=True),
        **_metric_diffs(ours_corr, corr, both_ways=False),
    }


def _value_loss_case(mode: str, ref: VerlReference) -> Diffs:
    g = torch.Generator().manual_seed(3)
    mask = _mask((7, 4, 6, 0, 7, 5), PG_T, {0: (2, 4)}).bool()
    old = torch.randn(6, PG_T, generator=g, dtype=torch.float64)
    vpreds = old + 0.8 * torch.randn(6, PG_T, generator=g, dtype=torch.float64)
    returns = torch.randn(6, PG_T, generator=g, dtype=torch.float64)
    if mode not in AGG_MODES:
        raise NotInSpmdrl(f"spmdrl has no loss_agg_mode {mode!r}")
    ours_v = vpreds.clone().requires_grad_(True)
    agg, info = _trainer_aggregation(mode, mask)
    ours_loss, ours_metrics = clipped_value_loss(ours_v, old, returns, mask, agg=agg, cliprange=0.5)
    ours_loss.backward()
    theirs_v = vpreds.clone().requires_grad_(True)
    theirs_loss, clipfrac = ref.core_algos.compute_value_loss(theirs_v, returns, old, mask, 0.5, mode, **info)
    theirs_loss.backward()
    # verl's critic logs vpred_mean as masked_mean(vpreds, response_mask) (workers/utils/losses.py).
    theirs_metrics = {"vf_clipfrac": clipfrac, "vpred_mean": ref.torch_functional.masked_mean(vpreds, mask)}
    return {
        "loss": _diff(ours_loss, theirs_loss),
        "grad": _diff(ours_v.grad, theirs_v.grad),
        **_metric_diffs(ours_metrics, theirs_metrics, both_ways=True),
    }


def _entropy_logprobs_case(ref: VerlReference) -> Diffs:
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    F = ref.torch_functional
    return {
        "entropy": _diff(entropy_from_logits(logits), F.entropy_from_logits(logits)),
        "logprobs": _diff(token_logprobs(logits, labels), F.logprobs_from_logits(logits, labels)),
    }


# ---------------------------------------------------------------------------------------------- KL


def _kl_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    logp = -3 * torch.rand(4, 6, generator=g, dtype=torch.float64)
    diff = torch.linspace(-4.0, 4.0, 24, dtype=torch.float64).reshape(4, 6)
    diff[0, 0], diff[3, 5] = -25.0, 25.0  # past the clamps (log ratio at 20, low_var_kl at 10)
    mask = _mask((6, 4, 5, 6), 6, {2: (1, 3)})
    return logp, logp + diff, mask


def _kl_case(kind: str, ref: VerlReference) -> Diffs:
    if kind.removesuffix("+") not in KL_ESTIMATORS:
        raise NotInSpmdrl(f"spmdrl has no KL estimator {kind!r}")
    logp, ref_logp, _ = _kl_inputs()
    out = {}
    for side, fn in (("spmdrl", kl_penalty), ("verl", ref.core_algos.kl_penalty)):
        lp, rp = logp.clone().requires_grad_(True), ref_logp.clone().requires_grad_(True)
        value = fn(lp, rp, kind)
        value.sum().backward()
        out[side] = (value.detach(), lp.grad, rp.grad)
    (v, g1, g2), (tv, tg1, tg2) = out["spmdrl"], out["verl"]
    return {"value": _diff(v, tv), "grad logprob": _diff(g1, tg1), "grad ref_logprob": _diff(g2, tg2)}


KL_UPDATES = ((0.05, 16), (0.3, 16), (0.1, 8), (0.0, 32), (0.15, 64))


def _kl_controller_case(ctrl_type: str, ref: VerlReference) -> Diffs:
    kwargs = {"kl_coef": 0.2, "target_kl": 0.1, "horizon": 100}
    ours = build_kl_controller(ctrl_type, **kwargs)
    theirs = ref.core_algos.get_kl_controller(ref.algorithm_config.KLControlConfig(type=ctrl_type, **kwargs))
    out = {}
    for step, (kl, n) in enumerate(KL_UPDATES):
        ours.update(kl, n)
        theirs.update(current_kl=kl, n_steps=n)
        out[f"value after update {step}"] = _diff(ours.value, theirs.value)
    return out


def _apply_kl_penalty_case(kind: str, ref: VerlReference) -> Diffs:
    logp, ref_logp, mask = _kl_inputs()
    scores = torch.zeros_like(logp)
    scores[:, -1] = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    kwargs = {"kl_coef": 0.2, "target_kl": 0.1, "horizon": 100}
    ours_ctrl = build_kl_controller("adaptive", **kwargs)
    coef = ours_ctrl.value
    rewards, mean_kl = apply_kl_penalty(scores, logp, ref_logp, mask, coef, kind)
    ours_ctrl.update(float(mean_kl), logp.shape[0])

    theirs_ctrl = ref.core_algos.get_kl_controller(
        ref.algorithm_config.KLControlConfig(type="adaptive", **kwargs)
    )
    data = DataProto.from_dict(
        tensors={
            "response_mask": mask,
            "token_level_scores": scores,
            "old_log_probs": logp,
            "ref_log_prob": ref_logp,
        }
    )
    data, metrics = ref.ray_trainer["apply_kl_penalty"](data, theirs_ctrl, kl_penalty=kind)
    return {
        "token_level_rewards": _diff(rewards, data.batch["token_level_rewards"]),
        "reward_kl_penalty": _diff(mean_kl, metrics["actor/reward_kl_penalty"]),
        "reward_kl_penalty_coeff": _diff(coef, metrics["actor/reward_kl_penalty_coeff"]),
        "kl_ctrl value after update": _diff(ours_ctrl.value, theirs_ctrl.value),
    }


# ---------------------------------------------------------------------------------------------- rollout correction


def _rc_batch(fully_masked_row: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    mask = _mask((8, 5, 7, 3, 8, 6, 0 if fully_masked_row else 2, 8), 8, {0: (2, 4), 4: (1, 3)})
    rollout = -3 * torch.rand(8, 8, generator=g, dtype=torch.float64)
    delta = 0.15 * torch.randn(8, 8, generator=g, dtype=torch.float64)
    delta[1, 2], delta[3, 0], delta[5, 4], delta[7, 7] = 1.2, -1.5, 0.9, -0.8
    return rollout + delta, rollout, mask


RS_THRESHOLDS = {
    "token_k1": "0.8_1.25",
    "token_k2": 0.02,
    "token_k3": 0.02,
    "seq_sum_k1": 1.3,  # a bare number: lower = 1 / upper
    "seq_sum_k2": 0.1,
    "seq_sum_k3": 0.1,
    "seq_mean_k1": "0.95_1.05",
    "seq_mean_k2": 0.015,
    "seq_mean_k3": 0.015,
    "seq_max_k2": 0.1,
    "seq_max_k3": 0.1,
}


def _rollout_is_case(
    level: str, threshold: float | str, normalize: bool, fully_masked_row: bool, ref: VerlReference
) -> Diffs:
    trainer, rollout, mask = _rc_batch(fully_masked_row)
    weights, metrics = rollout_is_weights(
        trainer,
        rollout,
        mask,
        rollout_is=level,
        rollout_is_threshold=threshold,
        rollout_is_batch_normalize=normalize,
    )
    theirs_w, theirs_metrics = ref.rollout_corr_helper.compute_rollout_correction_weights(
        trainer - rollout,
        mask,
        rollout_is=level,
        rollout_is_threshold=threshold,
        rollout_is_batch_normalize=normalize,
    )
    return {"weights": _diff(weights, theirs_w), **_metric_diffs(metrics, theirs_metrics, both_ways=False)}


def _rollout_rs_case(
    options: str, thresholds: str | float, fully_masked_row: bool, ref: VerlReference
) -> Diffs:
    trainer, rollout, mask = _rc_batch(fully_masked_row)
    ours_mask, metrics = rollout_rejection_mask(
        trainer, rollout, mask, rollout_rs=options, rollout_rs_threshold=thresholds
    )
    theirs_mask, theirs_metrics = ref.rollout_corr_helper.compute_rollout_rejection_mask(
        trainer - rollout, mask, rollout_rs=options, rollout_rs_threshold=thresholds
    )
    kept = float(theirs_mask.sum()) / float(mask.sum())
    assert 0.0 < kept < 1.0, f"test data: verl keeps {kept:.0%} of the tokens under {options}={thresholds}"
    return {"mask": _diff(ours_mask, theirs_mask), **_metric_diffs(metrics, theirs_metrics, both_ways=False)}


def _rollout_correction_case(ref: VerlReference) -> Diffs:
    trainer, rollout, mask = _rc_batch()
    kwargs = {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_max_k3",
        "rollout_rs_threshold": "0.8_1.25,0.1",
    }
    ours = rollout_correction(trainer, rollout, mask, **kwargs)
    theirs_w, theirs_mask, theirs_metrics = (
        ref.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
            trainer, rollout, mask, **kwargs
        )
    )
    return {
        "weights": _diff(ours.is_weights_BT, theirs_w.batch["rollout_is_weights"]),
        "mask": _diff(ours.mask_BT, theirs_mask),
        **_metric_diffs(ours.metrics, _strip(theirs_metrics, "rollout_corr/"), both_ways=False),
    }


def _rollout_metrics_ranks_case(rollout_is: str, ref: VerlReference) -> Diffs:
    """The maxima and minima of two ranks' metrics, reduced as ``metric_reduction`` says (max of maxima,
    min of minima), against verl's over the whole batch. (Means are averaged over ranks, each over its
    own tokens: equal to verl's only for equal shares, so not compared.)"""
    trainer, rollout, mask = _rc_batch()
    kwargs = {
        "rollout_is": rollout_is,
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k1,seq_max_k3",
        "rollout_rs_threshold": "0.8_1.25,0.1",
    }
    shards = [
        rollout_correction(trainer[r], rollout[r], mask[r], **kwargs).metrics
        for r in (slice(0, 5), slice(5, 8))
    ]
    reduce = {"max": max, "min": min}
    ours = {
        k: reduce[metric_reduction(k)](float(shard[k]) for shard in shards)
        for k in shards[0]
        if metric_reduction(k) in reduce
    }
    _, _, theirs = ref.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        trainer, rollout, mask, **kwargs
    )
    return _metric_diffs(ours, _strip(theirs, "rollout_corr/"), both_ways=False)


# ---------------------------------------------------------------------------------------------- DAPO


class _Tokenizer:
    eos_token = "</s>"

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


@dataclass
class _Cfg:
    """reward_model.overlong_buffer as verl's config object reads it (attributes)."""

    enable: bool
    len: int
    penalty_factor: float
    log: bool


def _overlong_case(ref: VerlReference) -> Diffs:
    max_len, prompt_len = 16, 3
    lengths = torch.tensor([1, 6, 10, 11, 13, 16])
    cfg = _Cfg(enable=True, len=6, penalty_factor=0.7, log=True)
    B = len(lengths)
    attention = torch.cat(
        [torch.ones(B, prompt_len), (torch.arange(max_len) < lengths.unsqueeze(1))], 1
    ).long()
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.zeros(B, prompt_len, dtype=torch.long),
            "responses": torch.zeros(B, max_len, dtype=torch.long),
            "attention_mask": attention,
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": ""}] * B, dtype=object),
            "data_source": np.array(["parity"] * B, dtype=object),
        },
    )
    manager = ref.dapo_reward_manager.DAPORewardManager(
        tokenizer=_Tokenizer(),
        num_examine=0,
        compute_score=lambda **_: 0.0,  # the reward is then the penalty alone
        max_resp_len=max_len,
        overlong_buffer_cfg=cfg,
    )
    out = manager(data, return_dict=True)
    info = out["reward_extra_info"]
    penalty = overlong_penalty(lengths, max_len, cfg.len, cfg.penalty_factor)
    # What verl records per sample under overlong_buffer.log; the recipe logs their batch means
    # (reward/overlong_penalty_mean, reward/overlong_frac).
    return {
        "penalty": _diff(penalty, out["reward_tensor"].sum(dim=1)),
        "overlong_reward": _diff(penalty, [float(x) for x in info["overlong_reward"]]),
        "overlong": _diff((penalty < 0).float(), [float(x) for x in info["overlong"]]),
    }


def _dapo_filter_case(values_by_group: tuple[tuple[float, ...], ...], ref: VerlReference) -> Diffs:
    """spmdrl's groups_with_signal against verl's DAPO group filter (ReplayBuffer._dapo_filtered_keys)."""
    rb = ref.replay_buffer
    buffer = rb.ReplayBuffer.__new__(rb.ReplayBuffer)  # only the state the filter reads
    buffer.filter_groups_metric = "acc"
    buffer.finished_keys = defaultdict(set)
    buffer.partitions = defaultdict(dict)
    buffer._dapo_classification_cache = defaultdict(dict)
    values, group_ids = [], []
    for gid, group_values in enumerate(values_by_group):
        buffer.finished_keys["train"].add(f"g{gid}")
        for j, v in enumerate(group_values):
            key = f"g{gid}_{j}"
            buffer.partitions["train"][key] = {}
            verl_reference.TRANSFER_QUEUE_STORE[key] = {"extra_fields": {"reward_extra_info": {"acc": v}}}
            values.append(v)
            group_ids.append(gid)
    with np.errstate(invalid="ignore"):  # np.std of a group holding inf
        filtered, _ = buffer._dapo_filtered_keys("train")
    theirs = torch.tensor([f"g{gid}" not in filtered for gid in group_ids])
    ours = groups_with_signal(torch.tensor(values, dtype=torch.float64), torch.tensor(group_ids))
    return {"kept samples": _diff(ours, theirs)}


# ---------------------------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    name: str
    verl_fn: str
    spmdrl_fn: str
    run: Callable[[VerlReference], Diffs]


def _cases() -> list[Case]:
    P = functools.partial
    cases: list[Case] = []

    def add(name: str, verl_fn: str, spmdrl_fn: str, run: Callable[[VerlReference], Diffs]) -> None:
        cases.append(Case(name, verl_fn, spmdrl_fn, run))

    for name in VERL_ADV_ESTIMATORS:
        fns = f"compute_advantage({name!r})", f"compute_advantages({name!r})"
        add(f"advantages {name}", *fns, P(_advantage_case, name, True))
        if name in ("grpo", "grpo_passk", "grpo_vectorized", "gdpo"):
            add(f"advantages {name}, norm_adv_by_std=False", *fns, P(_advantage_case, name, False))
    for name in VERL_ADV_ESTIMATORS:
        fns = f"compute_advantage({name!r})", f"compute_advantages({name!r}), batch_sum"
        add(f"advantages {name}, 2 ranks", *fns, P(_advantage_ranks_case, name))
    for mode in VERL_AGG_MODES:
        fns = f"agg_loss({mode!r}, global_batch_info)", "Aggregation, count_empty_rows"
        for empty in (False, True):
            label = f"aggregation {mode}, 2 ranks x 2 micro-batches" + (
                ", a fully masked row" if empty else ""
            )
            add(label, *fns, P(_aggregation_case, mode, empty, "explicit"))
    fns = "agg_loss(loss_scale_factor=None)", "Aggregation(norm_length=None)"
    add(
        "aggregation seq-mean-token-sum-norm, default divisor",
        *fns,
        P(_aggregation_case, VERL_AGG_MODES[-1], False, "default"),
    )
    for name in VERL_POLICY_LOSSES:
        fns = f"get_policy_loss_fn({name!r})", f"POLICY_LOSSES[{name!r}], agg_mode_for"
        modes = (
            VERL_AGG_MODES if name in ("gspo", "sapo", "geo_mean") else ("token-mean", "seq-mean-token-mean")
        )
        for mode in modes:
            if name == "bypass_mode":
                for loss_type in ("ppo_clip", "reinforce"):
                    add(
                        f"policy loss {name} ({loss_type}), {mode}",
                        *fns,
                        P(_policy_loss_case, name, mode, False, loss_type),
                    )
            else:
                add(
                    f"policy loss {name}, {mode}, IS weights",
                    *fns,
                    P(_policy_loss_case, name, mode, True, "ppo_clip"),
                )
    fns = "get_policy_loss_fn('vanilla')", "POLICY_LOSSES['vanilla']"
    add(
        "policy loss vanilla, token-mean, no IS weights",
        *fns,
        P(_policy_loss_case, "vanilla", "token-mean", False, "ppo_clip"),
    )
    for mode in VERL_AGG_MODES:
        add(f"value loss, {mode}", "compute_value_loss", "clipped_value_loss", P(_value_loss_case, mode))
    fns = "entropy_from_logits, logprobs_from_logits", "entropy_from_logits, token_logprobs"
    add("entropy and logprobs from logits", *fns, _entropy_logprobs_case)
    for kind in (*VERL_KL_KINDS, *(f"{k}+" for k in VERL_KL_KINDS)):
        add(f"KL estimator {kind}", f"kl_penalty({kind!r})", f"kl_penalty({kind!r})", P(_kl_case, kind))
    for ctrl in ("fixed", "adaptive"):
        add(f"KL controller {ctrl}", "get_kl_controller", "build_kl_controller", P(_kl_controller_case, ctrl))
    for kind in VERL_KL_KINDS:
        fns = f"ray_trainer.apply_kl_penalty({kind!r})", "apply_kl_penalty, KL controller update"
        add(f"KL in reward, {kind}, adaptive controller", *fns, P(_apply_kl_penalty_case, kind))
    fns = "compute_rollout_correction_weights", "rollout_is_weights"
    for level in ("token", "sequence"):
        for threshold in (2.0, "0.5_2.0"):
            for normalize in (False, True):
                label = f"rollout IS {level}, threshold {threshold}" + (
                    ", batch-normalized" if normalize else ""
                )
                add(label, *fns, P(_rollout_is_case, level, threshold, normalize, False))
        add(
            f"rollout IS {level}, threshold 2.0, a fully masked row",
            *fns,
            P(_rollout_is_case, level, 2.0, False, True),
        )
    fns = "compute_rollout_rejection_mask", "rollout_rejection_mask"
    for option in VERL_RS_OPTIONS:
        add(
            f"rollout RS {option} {RS_THRESHOLDS[option]}",
            *fns,
            P(_rollout_rs_case, option, RS_THRESHOLDS[option], False),
        )
    both = ("token_k1,seq_max_k3", "0.8_1.25,0.1")
    add(f"rollout RS {both[0]} {both[1]}", *fns, P(_rollout_rs_case, *both, False))
    add(f"rollout RS {both[0]} {both[1]}, a fully masked row", *fns, P(_rollout_rs_case, *both, True))
    fns = "compute_rollout_correction_and_rejection_mask", "rollout_correction"
    add("rollout correction: sequence IS, normalized, + 2 RS options", *fns, _rollout_correction_case)
    fns = "compute_rollout_correction_and_rejection_mask", "rollout_correction, metric_reduction"
    for level in ("token", "sequence"):
        label = f"rollout correction, {level} IS + 2 RS options, 2 ranks: maxima and minima"
        add(label, *fns, P(_rollout_metrics_ranks_case, level))
    add(
        "DAPO overlong penalty",
        "DAPORewardManager.__call__",
        "overlong_penalty",
        _overlong_case,
    )
    fns = "ReplayBuffer._dapo_filtered_keys", "groups_with_signal"
    finite = ((1.0, 1.0, 1.0), (0.0, 1.0, 0.0), (0.5,), (2.0, 2.0), (0.25, -0.25))
    add("DAPO group filter, finite metrics", *fns, P(_dapo_filter_case, finite))
    nonfinite = ((math.nan, 1.0), (math.inf, math.inf), (1.0, 1.0), (0.0, 1.0))
    add("DAPO group filter, NaN / inf metrics", *fns, P(_dapo_filter_case, nonfinite))
    return cases


CASES = _cases()


# ---------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def verl() -> VerlReference:
    try:
        return verl_reference.load()
    except verl_reference.VerlUnavailable as exc:
        pytest.skip(f"verl {verl_reference.VERL_VERSION} reference not available: {exc}")


def test_names_are_verls(verl: VerlReference) -> None:
    """The names parametrized here are the wheel's own (they would drift with another verl)."""
    assert set(VERL_ADV_ESTIMATORS) == set(verl.core_algos.ADV_ESTIMATOR_REGISTRY)
    assert set(VERL_POLICY_LOSSES) == set(verl.core_algos.POLICY_LOSS_REGISTRY)
    assert set(VERL_RS_OPTIONS) == verl.rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS


def _failures(diffs: Diffs) -> dict[str, float]:
    return {k: v for k, v in diffs.items() if not v <= TOL}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_parity(case: Case, verl: VerlReference) -> None:
    bad = _failures(case.run(verl))
    assert not bad, f"verl {case.verl_fn} vs spmdrl {case.spmdrl_fn} differ: " + ", ".join(
        f"{k} {v:.3g}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1])
    )


# ---------------------------------------------------------------------------------------------- the table


def _table_cell(case: Case, ref: VerlReference) -> str:
    try:
        diffs = case.run(ref)
    except Exception as exc:  # noqa: BLE001 - the table reports it
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, NotInSpmdrl):
            message = f"{type(exc).__name__}: {message}"
        return f"**fails**: {message}"
    worst = max(diffs.values(), default=0.0)
    if worst <= TOL:
        return f"{worst:.1e}"
    over = [k for k, v in sorted(diffs.items(), key=lambda kv: -kv[1]) if not v <= TOL]
    more = f" and {len(over) - 1} more" if len(over) > 1 else ""
    return f"**{worst:.2g}** ({over[0]}{more})"


def main() -> None:
    ref = verl_reference.load()
    start = time.perf_counter()
    print(f"| case | verl {verl_reference.VERL_VERSION} | spmdrl | max difference |")
    print("|---|---|---|---|")
    for case in CASES:
        print(
            f"| {case.name} | `{case.verl_fn}` | `{case.spmdrl_fn}` | {_table_cell(case, ref)} |", flush=True
        )
    print(f"\n{len(CASES)} cases in {time.perf_counter() - start:.0f}s; tolerance {TOL:g}.", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:] != ["--table"]:
        raise SystemExit("usage: python tests/unit/algos/test_verl_parity.py --table")
    main()
