"""DAPO's data-side pieces (arXiv:2503.14476) as pure functions: dynamic sampling and overlong shaping.

DAPO's loss-side pieces live elsewhere: clip-higher is ``algorithm.clip_ratio_low`` / ``_high`` of the
``vanilla`` policy loss, token-level loss is ``algorithm.loss_agg_mode=token-mean``. The two pieces here
change which samples and which rewards reach the advantage estimator:

- **Dynamic sampling** (verl: ``algorithm.filter_groups.enable``, ``.metric``, ``.max_num_gen_batches``;
  verl 0.9.1's ``ReplayBuffer._dapo_filtered_keys`` in ``verl/trainer/ppo/v1/replay_buffer.py``, the
  legacy ``recipe/dapo/dapo_ray_trainer.py`` before it). A group whose samples all got the same metric
  (all right or all wrong) has advantage 0 for every sample under GRPO and so gives no gradient; it is
  dropped, and the recipe generates further batches until it has ``data.train_batch_size`` (spmdrl:
  ``trainer.global_batch_size``) groups left, then takes the first ones.
  :func:`groups_with_signal` is the filter, :func:`should_generate_more` the "another batch?" decision,
  :func:`num_groups_to_take` and :func:`first_groups_mask` the trim to exactly the target.
- **Overlong reward shaping** (verl: ``reward_model.overlong_buffer.enable``, ``.len``,
  ``.penalty_factor``, ``.log``; ``verl/workers/reward_manager/dapo.py``): :func:`overlong_penalty`, a
  penalty growing linearly over the last ``len`` tokens before the maximum response length, added to
  the score.

SPMD use: each rank holds whole groups (all samples of a prompt on one rank). :func:`groups_with_signal`,
:func:`count_groups` and :func:`first_groups_mask` look at this rank's tensors only; the counts they give
are summed over ranks (one all_reduce) or gathered (one all_gather) by the recipe before
:func:`should_generate_more` and :func:`num_groups_to_take`, which take *global* numbers so that every
rank reaches the same decision and the ranks together take exactly the target number of groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_groups(name: str, x_B: torch.Tensor, group_ids_B: torch.Tensor) -> None:
    if x_B.dim() != 1:
        raise ValueError(f"{name} must be 1-D (B,), got shape {tuple(x_B.shape)}")
    if tuple(group_ids_B.shape) != tuple(x_B.shape):
        raise ValueError(f"group_ids_B {tuple(group_ids_B.shape)} and {name} {tuple(x_B.shape)} differ")
    if group_ids_B.is_floating_point() or group_ids_B.dtype == torch.bool:
        raise ValueError("group_ids_B must be an integer tensor (one id per prompt)")


# ---------------------------------------------------------------------------------------------- dynamic sampling


@torch.no_grad()
def groups_with_signal(values_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """Bool (B,): the samples whose group's metric values are not all equal (or not all finite), plus
    every group of one.

    ``values_B`` is the ``filter_groups.metric`` of each sample: ``reward`` (verl 0.9.1's default: the
    reward the advantages start from, overlong penalty included, before any KL penalty), ``acc`` or
    ``score`` as the reward function reports them, or ``seq_final_reward``. Groups are the samples
    sharing a ``group_ids_B`` value; ids need not be consecutive, nor groups contiguous or equal-sized.

    verl 0.9.1 drops a group ``g`` iff ``len(values_g) > 1 and np.std(values_g) == 0``. Here: dropped
    iff it has two or more samples, all finite and all equal (``max_g == min_g``). The two agree except
    where verl's squared deviations underflow to 0 (differences below ~1e-162 in float64, ~1e-23 in
    float32), which verl drops and spmdrl keeps: comparing values exactly, any difference at all is a
    signal. A group with a NaN or an infinity is kept, as in verl 0.9.1 (its std is NaN, and ``NaN == 0``
    is false; the legacy DAPO recipe, which kept ``std > 0``, dropped it). A group of one is kept although
    its GRPO advantage is its raw reward, not 0, as verl does.
    """
    _check_groups("values_B", values_B, group_ids_B)
    if values_B.dtype == torch.bool:
        values_B = values_B.long()
    # Values are compared in their own dtype: no cast that could merge two nearby floats.
    _, inverse_B, count_G = torch.unique(group_ids_B, return_inverse=True, return_counts=True)
    G = count_G.numel()
    # include_self=False: every group has a member, so each slot is written and empty()'s junk unused.
    max_G = values_B.new_empty(G).scatter_reduce(0, inverse_B, values_B, "amax", include_self=False)
    min_G = values_B.new_empty(G).scatter_reduce(0, inverse_B, values_B, "amin", include_self=False)
    nonfinite_G = torch.zeros(G, dtype=torch.long, device=values_B.device)
    nonfinite_G.index_add_(0, inverse_B, (~torch.isfinite(values_B)).long())
    keep_G = (count_G == 1) | (max_G > min_G) | (nonfinite_G > 0)
    return keep_G[inverse_B]


def _group_keep(keep_B: torch.Tensor, group_ids_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_G, inverse_B) over the unique ids, checking that ``keep_B`` keeps or drops whole groups."""
    _check_groups("keep_B", keep_B, group_ids_B)
    _, inverse_B, count_G = torch.unique(group_ids_B, return_inverse=True, return_counts=True)
    kept_G = torch.zeros_like(count_G).index_add_(0, inverse_B, keep_B.bool().long())
    if not bool(((kept_G == 0) | (kept_G == count_G)).all()):
        raise ValueError("keep_B must keep or drop whole groups (it is not constant within a group id)")
    return kept_G > 0, inverse_B


def count_groups(keep_B: torch.Tensor, group_ids_B: torch.Tensor) -> tuple[int, int]:
    """(kept, dropped) groups of this rank's batch under ``keep_B`` (from :func:`groups_with_signal`).

    Sum both over ranks (each rank holds whole groups, so no group is counted twice): the kept sum is
    the ``num_kept_groups`` that :func:`should_generate_more` takes.
    """
    keep_G, _ = _group_keep(keep_B, group_ids_B)
    kept = int(keep_G.sum())
    return kept, keep_G.numel() - kept


def should_generate_more(
    num_kept_groups: int, target_groups: int, num_gen_batches: int, max_num_gen_batches: int
) -> bool:
    """Whether the recipe must generate another batch before it can train.

    ``num_kept_groups``: groups kept so far in this step, over all generation batches and **all ranks**
    (the recipe all_reduces its :func:`count_groups` counts first: the answer must be the same on every
    rank, or the ranks would disagree on whether to generate and the next collective would hang).
    ``target_groups``: prompts per step (spmdrl ``trainer.global_batch_size``, verl
    ``data.train_batch_size``). ``num_gen_batches``: batches generated in this step, the latest included
    (verl logs it as ``train/num_gen_batches``). ``max_num_gen_batches``: ``filter_groups.max_num_gen_batches``,
    <= 0 for no limit (its default, verl's; verl 0.9.1 documents the limit but its replay buffer never
    reads it, so it generates without one whatever the setting; the legacy DAPO recipe raised as here).

    Returns False when ``num_kept_groups >= target_groups`` (train now, on the first ``target_groups``
    groups), True when short and ``max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches``.
    Raises ValueError when short after ``max_num_gen_batches`` batches.
    """
    if target_groups <= 0:
        raise ValueError(f"target_groups must be > 0, got {target_groups}")
    if num_gen_batches <= 0:
        raise ValueError(
            f"num_gen_batches counts the batch just generated, so it is >= 1, got {num_gen_batches}"
        )
    if num_kept_groups >= target_groups:
        return False
    if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
        return True
    raise ValueError(
        f"dynamic sampling kept {num_kept_groups} groups with signal (samples whose "
        f"algorithm.filter_groups.metric differs) after {num_gen_batches} generation batches, fewer than the "
        f"{target_groups} prompts of a step, and algorithm.filter_groups.max_num_gen_batches="
        f"{max_num_gen_batches} allows no more. Raise algorithm.filter_groups.max_num_gen_batches (0 = no "
        f"limit), lower trainer.global_batch_size, or check the data is not too hard or too easy for the "
        f"model (every sample of most prompts gets the same reward)"
    )


def num_groups_to_take(kept_before: int, kept_per_rank: Sequence[int], rank: int, target_groups: int) -> int:
    """How many of this rank's groups kept from the latest generation batch go into the training batch.

    verl concatenates the kept samples of every generation batch in order and takes the first
    ``train_batch_size * n`` of them, i.e. the first ``target_groups`` kept groups. Every earlier batch
    left the step short, so all ``kept_before`` groups from earlier batches are taken; only the latest
    batch is cut. Its global order is rank 0's kept groups, then rank 1's, ... (the order of an
    all_gather), each in the rank's own order, so rank ``r`` takes
    ``clamp(target_groups - kept_before - sum(kept_per_rank[:r]), 0, kept_per_rank[r])``, its first ones
    (:func:`first_groups_mask`). Summed over ranks, the result is ``target_groups - kept_before``.

    ``kept_before``: global kept groups of the earlier batches of this step; ``kept_per_rank``: the kept
    groups of the latest batch on each rank (all_gathered, the same list on every rank).
    """
    if not 0 <= rank < len(kept_per_rank):
        raise ValueError(f"rank {rank} is outside kept_per_rank of length {len(kept_per_rank)}")
    if kept_before < 0 or any(k < 0 for k in kept_per_rank):
        raise ValueError(f"kept counts must be >= 0, got kept_before={kept_before}, {list(kept_per_rank)}")
    total = kept_before + sum(kept_per_rank)
    if kept_before >= target_groups or total < target_groups:
        raise ValueError(
            f"num_groups_to_take is for the batch that reaches target_groups={target_groups}: kept_before="
            f"{kept_before} must be below it and kept_before + sum(kept_per_rank)={total} at least it "
            f"(see should_generate_more)"
        )
    before_me = kept_before + sum(kept_per_rank[:rank])
    return max(0, min(target_groups - before_me, kept_per_rank[rank]))


@torch.no_grad()
def first_groups_mask(keep_B: torch.Tensor, group_ids_B: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Bool (B,): the samples of the first ``num_groups`` groups kept by ``keep_B``.

    Groups are ordered by their first sample's position in the batch (verl's ``batch[:traj_bsz]`` takes
    a prefix of the samples, and its groups are contiguous). ``keep_B`` must keep or drop whole groups,
    and keep at least ``num_groups`` of them.
    """
    keep_G, inverse_B = _group_keep(keep_B, group_ids_B)
    available = int(keep_G.sum())
    if not 0 <= num_groups <= available:
        raise ValueError(f"num_groups must be in [0, {available}] (the kept groups), got {num_groups}")
    B = inverse_B.numel()
    positions_B = torch.arange(B, device=inverse_B.device)
    first_G = torch.full_like(keep_G, B, dtype=torch.long).scatter_reduce(0, inverse_B, positions_B, "amin")
    order_G = torch.argsort(first_G)  # unique ids sort by value; reorder them by first appearance
    kept_in_order_G = keep_G[order_G]
    take_in_order_G = kept_in_order_G & (kept_in_order_G.long().cumsum(0) <= num_groups)
    take_G = torch.empty_like(keep_G)
    take_G[order_G] = take_in_order_G
    return take_G[inverse_B]


def dynamic_sampling_metrics(
    num_gen_batches: int, num_kept_groups: int, num_dropped_groups: int
) -> dict[str, float]:
    """The step's dynamic-sampling metrics, from global counts summed over its generation batches.

    ``num_gen_batches`` is verl's name (logged as ``train/num_gen_batches``); verl does not log the group
    counts, so ``num_kept_groups`` / ``num_dropped_groups`` / ``kept_group_fraction`` are spmdrl's names
    (kept counts every kept group, including any beyond the target that were not trained on).
    """
    total = num_kept_groups + num_dropped_groups
    return {
        "num_gen_batches": float(num_gen_batches),
        "num_kept_groups": float(num_kept_groups),
        "num_dropped_groups": float(num_dropped_groups),
        "kept_group_fraction": num_kept_groups / total if total else 0.0,
    }


# ---------------------------------------------------------------------------------------------- overlong shaping


@torch.no_grad()
def overlong_penalty(
    response_lengths_B: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """Float32 (B,) penalties (<= 0) to add to each sample's score: DAPO's soft overlong punishment.

    With ``L`` a response's length (valid tokens), ``L_max = max_response_length``, ``L_buf =
    buffer_len`` (verl ``overlong_buffer.len``) and ``p = penalty_factor``, as verl's DAPO reward manager::

        penalty = min(-(L - (L_max - L_buf)) / L_buf * p, 0)

    so 0 up to ``L_max - L_buf``, then linear down to ``-p`` at ``L_max``. Like verl there is no lower
    clamp: a length beyond ``L_max`` (which verl's rollout, truncating at ``L_max``, never produces)
    continues the line below ``-p``. The paper's eq. 13 is this function with ``p = 1``, except that it
    gives ``-1`` beyond ``L_max``.
    """
    if response_lengths_B.dim() != 1:
        raise ValueError(f"response_lengths_B must be 1-D (B,), got shape {tuple(response_lengths_B.shape)}")
    # verl asserts the second; the first would divide by zero.
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer.len must be in (0, max_response_length={max_response_length}], got {buffer_len}"
        )
    # A negative factor would reward long answers past the buffer's start and penalise short ones.
    if penalty_factor < 0:
        raise ValueError(f"overlong_buffer.penalty_factor must be >= 0, got {penalty_factor}")
    exceed_B = response_lengths_B.float() - float(max_response_length - buffer_len)
    return (-exceed_B / buffer_len * penalty_factor).clamp_max(0.0)


def overlong_metrics(penalty_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """Batch means of what verl records per sample when ``overlong_buffer.log`` is set:
    ``overlong_reward`` (the penalty) and ``overlong`` (penalty < 0, here the fraction of samples).
    Detached 0-dim tensors (no device sync here)."""
    penalty_B = penalty_B.detach().float()
    if penalty_B.numel() == 0:
        zero = penalty_B.new_zeros(())
        return {"overlong_reward": zero, "overlong": zero}
    return {"overlong_reward": penalty_B.mean(), "overlong": (penalty_B < 0).float().mean()}
