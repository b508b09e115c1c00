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
  :func:`dynamic_sampling_metrics` the step's counts.
- **Overlong reward shaping** (verl: ``reward_model.overlong_buffer.enable``, ``.len``,
  ``.penalty_factor``, ``.log``; ``verl/workers/reward_manager/dapo.py``): :func:`overlong_penalty`, a
  penalty growing linearly over the last ``len`` tokens before the maximum response length, added to
  the score.

SPMD use: each rank holds whole groups (all samples of a prompt on one rank), and every rank must end
with the same number of rows. :func:`groups_with_signal` looks at this rank's tensors only; the GRPO
recipe's rollout asks :func:`should_generate_more` with the *smallest* per-rank count of kept groups (one
all_reduce MIN per batch), so every rank reaches the same decision, and each rank then trains on its own
first ``global_batch_size / world`` kept prompts.
"""

from __future__ import annotations

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


def should_generate_more(
    num_kept_groups: int, target_groups: int, num_gen_batches: int, max_num_gen_batches: int
) -> bool:
    """Whether the recipe must generate another batch before it can train.

    ``num_kept_groups``: groups kept so far in this step, over all generation batches, a number every rank
    agrees on (the GRPO recipe passes the smallest per-rank count, an all_reduce MIN: the answer must be the
    same on every rank, or the ranks would disagree on whether to generate and the next collective would
    hang). ``target_groups``: the groups the step trains on, counted alike (the recipe: a rank's prompts
    per step, ``trainer.global_batch_size / world``; verl: ``data.train_batch_size`` over all ranks).
    ``num_gen_batches``: batches generated in this step, the latest included
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
