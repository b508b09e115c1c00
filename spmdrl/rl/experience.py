"""Make experience: a step's ScoredSamples -> the rows the update trains on (PolicyBatch), in verl's order.

- policy_batch: the samples as rows (prompt + response tokens, masks, engine logprobs) with each
  sample's reward at its last response token.
- needs_old_logprobs, old_and_ref_logprobs: the old policy's logprobs (a separate pass only when
  something needs them before, or apart from, the update's first forward) and the reference's.
- batch_advantages: the KL to the reference folded into the reward (kl_in_reward), the rollout
  correction (correct_rollout), then algorithm.adv_estimator (advantage_estimator); a rank holds whole
  groups, so only batch-wide statistics are summed over the actor's ranks.
- gdpo_reward_components: gdpo's per-component rewards from the reward function's dict.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from spmdrl.algos.advantages import (
    AdvantageInputs,
    adv_estimator,
    compute_advantages,
    token_level_rewards,
)
from spmdrl.algos.config import AlgorithmConfig, RolloutCorrectionConfig, TeacherConfig
from spmdrl.algos.correction import metric_reduction, rollout_correction
from spmdrl.algos.distill import distill_advantages, mix_advantages, reverse_kl_sums
from spmdrl.algos.kl_control import AdaptiveKLController, FixedKLController, apply_kl_penalty
from spmdrl.derived import RLDerived
from spmdrl.distributed.exchange import RowLayout, gather_lengths, move_rows
from spmdrl.distributed.placement import Placement
from spmdrl.distributed.reduce import (
    all_reduce_max,
    all_reduce_min,
    all_reduce_sum,
    all_reduce_sum_tensors,
    sum_over_group,
)
from spmdrl.models.head import fused_chunk_for
from spmdrl.rewards.config import RewardConfig
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.batch import IMAGE_SHAPE, PolicyBatch, build_policy_batch, pack_images, unpack_images
from spmdrl.rl.reference import Reference
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rl.teacher import Teacher
from spmdrl.rl.update import UpdateSettings, logprobs_and_sum_pi_squared_of, logprobs_of, micro_rows
from spmdrl.rollout.mismatch import corrected_mismatch


def policy_batch(samples: ScoredSamples, pad_id: int, device: torch.device) -> PolicyBatch:
    """This rank's samples as rows, each with its training reward at its last response token (where
    verl's reward managers put an outcome reward)."""
    # A VLM's rows: their prompts' images (every prompt of a VLM has its ImagePrompt) and the images their
    # tools returned (Generation.images). Listed per prompt, None where one has none, so that a prompt
    # without images never shifts the next one's.
    vision = any(p.image is not None for p in samples.prompts) or any(
        g.images is not None for g in samples.gens
    )
    batch = build_policy_batch(
        [p.prompt_ids for p in samples.prompts],
        samples.gens,
        pad_id=pad_id,
        images=[p.image.pixels if p.image is not None else None for p in samples.prompts] if vision else None,
    ).to(device)
    return batch.replace(
        token_rewards_BT=token_level_rewards(samples.scores_B.to(device), batch.response_mask_BT)
    )


def old_and_ref_logprobs(
    settings: UpdateSettings,
    rl: RLDerived,
    actor: torch.nn.Module,
    ref: Reference | None,
    batch: PolicyBatch,
    group: dist.ProcessGroup | None,
    *,
    recompute_old: bool,
    teacher: Teacher | None = None,
) -> PolicyBatch:
    """No-grad passes over the actor's rows: the old policy's logprobs when ``recompute_old``
    (needs_old_logprobs), with the sum of squared probabilities when the estimator reads it, the
    reference's logprobs when there is a reference (a KL term; under LoRA the actor with its adapters off,
    spmdrl.rl.reference), and the teacher's when there is one (teacher.*: on-policy distillation). Every
    rank of ``group`` calls it."""
    if not (recompute_old or ref is not None or teacher is not None):
        return batch
    temp, pack = settings.temperature, settings.trainer.pack_sequences
    # One micro-batch plan for every pass (a collective over ``group``): they all read the same rows.
    parts = micro_rows(settings.trainer, rl, batch, group)
    if recompute_old:
        # The optimal token baseline also reads each step's sum of squared probabilities.
        old_BT, sps_BT = logprobs_and_sum_pi_squared_of(
            actor,
            batch,
            parts,
            temp,
            pack,
            adv_estimator(settings.algorithm.adv_estimator).needs_sum_pi_squared,
            fused_chunk_tokens=fused_chunk_for(settings.model, actor),
        )
        batch = batch.replace(old_logprobs_BT=old_BT, sum_pi_squared_BT=sps_BT)
    if ref is not None:
        fused = fused_chunk_for(settings.model, ref.model)
        with ref.scoring():
            ref_BT = logprobs_of(ref.model, batch, parts, temp, pack, fused)
        batch = batch.replace(ref_logprobs_BT=ref_BT)
    if teacher is not None:
        batch = batch.replace(teacher_logprobs_BT=_teacher_logprobs(settings, teacher, batch, parts))
    return batch


def _teacher_logprobs(
    settings: UpdateSettings, teacher: Teacher, batch: PolicyBatch, parts: list[torch.Tensor]
) -> torch.Tensor:
    """The teacher's no-grad pass over ``batch``, micro-batch by micro-batch (``parts``: micro_rows')."""
    fused = fused_chunk_for(settings.model, teacher.model)
    return logprobs_of(
        teacher.model, batch, parts, settings.temperature, settings.trainer.pack_sequences, fused
    )


def teacher_logprobs_apart(
    settings: UpdateSettings,
    rl: RLDerived,
    teacher: Teacher | None,
    batch: PolicyBatch,
    placement: Placement,
    teacher_group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """parallel.teacher_ranks (the teacher on ranks of its own): the teacher's logprobs of this rank's rows,
    scored on the teacher's ranks. Every rank's rows (tokens and masks) go there in order, in blocks that
    differ by one row at most (a VLM's images with them); each teacher rank scores its share (micro-batches planned over
    ``teacher_group``); the logprobs come back to the rows' ranks, by the point-to-point moves PPO's split
    placement moves the critic's values by (spmdrl.distributed.exchange). Every rank calls it (``teacher``:
    the module on the teacher's ranks, None elsewhere)."""
    sizes, lengths_N = gather_lengths(batch.attention_mask_BT.sum(dim=1), device)
    width = int(lengths_N.max())
    here = RowLayout.from_counts(sizes)
    ranks, total = placement.role("teacher").ranks, lengths_N.numel()
    there = RowLayout.from_counts(
        [total // len(ranks) + (i < total % len(ranks)) for i in range(len(ranks))], ranks
    )
    fields = {k: getattr(batch, k) for k in ("input_ids_BT", "attention_mask_BT", "response_mask_BT")}
    if batch.images is not None:  # a VLM's: the teacher's forward takes each row's images with it
        fields.update(pack_images(batch.images, batch.num_rows, device))
    spec = {k: v.dtype for k, v in fields.items()}
    # The images make each field travel at its own width (a row's pixels are wider than its tokens).
    rows = move_rows(fields, spec, here, there, width=None if IMAGE_SHAPE in spec else width, device=device)
    scored = None
    if rows is not None:
        assert teacher is not None, "the teacher's ranks hold the teacher"
        images = unpack_images(rows) if IMAGE_SHAPE in rows else None
        tokens = {k: rows[k][:, :width] for k in ("input_ids_BT", "attention_mask_BT", "response_mask_BT")}
        zeros_BT = torch.zeros(tokens["input_ids_BT"].shape, dtype=torch.float32, device=device)
        theirs = PolicyBatch(**tokens, engine_logprobs_BT=zeros_BT, advantages_BT=zeros_BT, images=images)
        parts = micro_rows(settings.trainer, rl, theirs, teacher_group)
        scored = {"teacher_logprobs_BT": _teacher_logprobs(settings, teacher, theirs, parts)}
    back = move_rows(scored, {"teacher_logprobs_BT": torch.float32}, there, here, width=width, device=device)
    assert back is not None, "every rank holds rows"
    return back["teacher_logprobs_BT"][:, : batch.input_ids_BT.shape[1]]


def advantage_estimator(
    algo: AlgorithmConfig,
    samples_per_prompt: int,
    num_prompts: int,
    baseline_B: torch.Tensor | None,
    values_BT: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    old_logprobs_BT: torch.Tensor | None = None,
    sum_pi_squared_BT: torch.Tensor | None = None,
    is_weights_BT: torch.Tensor | None = None,
    reward_components_BK: torch.Tensor | None = None,
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """algorithm.adv_estimator over this rank's rows (``samples_per_prompt``, rollout.n, consecutive
    samples per prompt):
    ``(token_rewards_BT, response_mask_BT) -> (advantages_BT, returns_BT)``. Group statistics are the
    rank's own (it holds whole groups); batch-wide ones are summed over ``group``, the actor's ranks, as
    verl computes them over the whole batch. Every rank of ``group`` must call it. The optimal token
    baseline reads the old logprobs, their sum of squared probabilities and any rollout-correction
    weights; gdpo its reward components (gdpo_reward_components)."""
    a = algo
    weights_K = tuple(a.gdpo_reward_weights) if a.gdpo_reward_weights is not None else None

    def advantages(
        token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = AdvantageInputs(
            token_rewards_BT,
            response_mask_BT,
            group_ids_B=torch.arange(num_prompts).repeat_interleave(samples_per_prompt),
            values_BT=values_BT,
            baseline_B=baseline_B,
            batch_sum=sum_over_group(group),
            old_logprobs_BT=old_logprobs_BT,
            sum_pi_squared_BT=sum_pi_squared_BT,
            is_weights_BT=is_weights_BT,
            reward_components_BK=reward_components_BK,
            reward_weights_K=weights_K,
            gamma=a.gamma,
            lam=a.lam,
            norm_by_std=a.norm_adv_by_std,
        )
        return compute_advantages(a.adv_estimator, inputs)

    return advantages


def kl_in_reward(
    algo: AlgorithmConfig,
    batch: PolicyBatch,
    token_rewards_BT: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's use_kl_in_reward: rewards minus coef x KL(old policy || reference) per token on the sampled
    mask, the old policy being verl's old_log_probs: the trainer's recomputed logprobs, or the engine's in
    rollout_correction.bypass_mode (where verl sets old_log_probs to them). The adaptive controller moves
    coef with the KL of the whole batch (all ranks), so every rank agrees."""
    policy_BT = batch.engine_logprobs_BT if algo.rollout_correction.bypass_mode else batch.old_logprobs_BT
    assert batch.ref_logprobs_BT is not None and policy_BT is not None, "needs_old_logprobs says when"
    rewards_BT, mean_kl = apply_kl_penalty(
        token_rewards_BT,
        policy_BT,
        batch.ref_logprobs_BT,
        batch.response_mask_BT,
        kl_ctrl.value,
        algo.kl_penalty,
    )
    total = all_reduce_sum({"kl": float(mean_kl) * batch.num_rows, "n": batch.num_rows}, device, group)
    coef = kl_ctrl.value
    kl_ctrl.update(total["kl"] / total["n"], int(total["n"]))
    return rewards_BT, {
        "actor/reward_kl_penalty": total["kl"] / total["n"],
        "actor/reward_kl_penalty_coeff": coef,
    }


def correct_rollout(
    rc: RolloutCorrectionConfig,
    batch: PolicyBatch,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> tuple[PolicyBatch, dict[str, float]]:
    """verl's rollout correction (algorithm.rollout_correction): importance weights and rejection of the
    tokens or sequences whose engine logprobs stray too far from the trainer's
    (spmdrl/algos/correction.py)."""
    assert batch.old_logprobs_BT is not None
    corr = rollout_correction(
        batch.old_logprobs_BT,
        batch.engine_logprobs_BT,
        batch.response_mask_BT,
        rollout_is=rc.rollout_is or None,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs or None,
        rollout_rs_threshold=rc.rollout_rs_threshold or None,
    )
    # Over ranks: maxima by their max, minima by their min (verl computes them on the whole batch), the
    # rest as the mean of each rank's value (each over its own tokens).
    values = {k: float(v) for k, v in corr.metrics.items()}
    by = {r: {k: v for k, v in values.items() if metric_reduction(k) == r} for r in ("mean", "max", "min")}
    world = dist.get_world_size(group) if dist.is_initialized() else 1  # as all_reduce_*: one process
    reduced = {k: v / world for k, v in all_reduce_sum(by["mean"], device, group).items()}
    reduced.update(all_reduce_max(by["max"], device, group))
    reduced.update(all_reduce_min(by["min"], device, group))
    metrics = {f"rollout_corr/{k}": v for k, v in sorted(reduced.items())}
    # The gap the correction leaves, next to mismatch/* (the gap before it; docs/rollout.md).
    residual = corrected_mismatch(
        batch.old_logprobs_BT,
        batch.engine_logprobs_BT,
        corr.mask_BT,
        corr.is_weights_BT,
        sequence_level=rc.rollout_is == "sequence",
        group=group or dist.group.WORLD,
    )
    metrics.update({f"mismatch/{k}": v for k, v in residual.items()})
    return batch.replace(response_mask_BT=corr.mask_BT, is_weights_BT=corr.is_weights_BT), metrics


def batch_advantages(
    algo: AlgorithmConfig,
    samples_per_prompt: int,
    batch: PolicyBatch,
    baseline_B: torch.Tensor | None,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    reward_components_BK: torch.Tensor | None = None,
    teacher: TeacherConfig | None = None,
) -> tuple[PolicyBatch, dict[str, float]]:
    """The advantages on the actor's ranks, in verl's order (its fit loop): the KL to the reference folded into
    the reward if asked (on the sampled mask), the rollout correction (its rejection edits the response
    mask), then algorithm.adv_estimator on the edited mask, so rejected tokens take no part in the
    whitening and returns. A rank holds whole groups (``samples_per_prompt``, rollout.n, rows each); the
    batch-wide statistics are summed over ``group``. With a teacher (``teacher``: its section, when the
    batch holds its logprobs) the distillation's dense advantages replace the task's or join them
    (:func:`distill_experience`).
    """
    a = algo
    assert batch.token_rewards_BT is not None
    token_rewards_BT, metrics = batch.token_rewards_BT, {}
    if a.use_kl_in_reward:
        token_rewards_BT, metrics = kl_in_reward(a, batch, token_rewards_BT, kl_ctrl, device, group)
    if a.rollout_correction.enabled:
        batch, corr_metrics = correct_rollout(a.rollout_correction, batch, device, group)
        metrics.update(corr_metrics)
    estimate = advantage_estimator(
        a,
        samples_per_prompt,
        batch.num_rows // samples_per_prompt,
        baseline_B,
        batch.values_BT,
        group,
        old_logprobs_BT=batch.old_logprobs_BT,
        sum_pi_squared_BT=batch.sum_pi_squared_BT,
        is_weights_BT=batch.is_weights_BT,
        reward_components_BK=reward_components_BK,
    )
    advantages_BT, returns_BT = estimate(token_rewards_BT, batch.response_mask_BT)
    batch = batch.replace(advantages_BT=advantages_BT, returns_BT=returns_BT)
    if teacher is not None and teacher.enabled:
        batch, distill_metrics = distill_experience(teacher, batch, group)
        metrics.update(distill_metrics)
    return batch, metrics


def distill_experience(
    teacher: TeacherConfig, batch: PolicyBatch, group: dist.ProcessGroup | None = None
) -> tuple[PolicyBatch, dict[str, float]]:
    """On-policy distillation on the actor's rows: the per-token reverse KL to the teacher (the metric
    distill/reverse_kl, over ``group``'s rows) and, under teacher.use_policy_gradient, the dense advantage
    -(log pi - log pi_T) on each sampled token, alone or added to the task's (teacher.use_task_rewards);
    without it the task's advantages stay (zero without the task reward) and the update adds the loss
    term. The student's logprobs are the old policy's: recomputed when a pass made them, else the
    engine's, the policy that sampled the tokens."""
    assert batch.teacher_logprobs_BT is not None, "old_and_ref_logprobs scores the teacher"
    student_BT = batch.old_logprobs_BT if batch.old_logprobs_BT is not None else batch.engine_logprobs_BT
    mask_BT = batch.response_mask_BT
    kl_sum, tokens = reverse_kl_sums(student_BT, batch.teacher_logprobs_BT, mask_BT)
    total = all_reduce_sum_tensors({"kl": kl_sum, "tokens": tokens}, group)
    metrics = {"distill/reverse_kl": total["kl"] / max(total["tokens"], 1.0)}
    if teacher.use_policy_gradient:
        distill_BT = distill_advantages(teacher, student_BT, batch.teacher_logprobs_BT, mask_BT)
        advantages_BT = mix_advantages(teacher, batch.advantages_BT, distill_BT)
        batch = batch.replace(advantages_BT=advantages_BT)
    elif not teacher.use_task_rewards:
        batch = batch.replace(advantages_BT=torch.zeros_like(batch.advantages_BT))
    return batch, metrics


def needs_old_logprobs(algo: AlgorithmConfig, rl: RLDerived) -> bool:
    """Whether the old logprobs get a pass of their own (old_and_ref_logprobs). verl always does (outside its rollout-correction
    bypass mode); here only when the update's first forward is not the old policy (several optimizer
    steps), or when something needs them before the update: the rollout correction, and the KL in the
    reward (verl's apply_kl_penalty reads old_log_probs: recomputed ones, the engine's only in bypass
    mode)."""
    a = algo
    if a.rollout_correction.bypass_mode:
        return False  # the engine's logprobs are the old ones (verl's apply_bypass_mode)
    if a.recompute_old_logprobs == "always":
        return True
    # Every other reader takes the update's first forward, detached, which is the old policy when it runs
    # before any optimizer step: the policy loss's ratio (kl_cov / clip_cov too), the mismatch metrics
    # (UpdateResult.old_logprobs_BT). What reads them before the update, or a later optimizer step, cannot.
    # The optimal token baseline reads the old policy's logprobs and sum of squared probabilities.
    otb = adv_estimator(a.adv_estimator).needs_sum_pi_squared
    several_steps = a.ppo_epochs > 1 or rl.mini_batches_per_step > 1
    return several_steps or a.rollout_correction.enabled or a.use_kl_in_reward or otb


def gdpo_reward_components(
    algo: AlgorithmConfig, reward: RewardConfig, rewards: RewardResult
) -> torch.Tensor | None:
    """(B, K): each sample's algorithm.gdpo_reward_keys, from the reward function's returned dict; None
    for any other estimator."""
    a = algo
    if a.adv_estimator != "gdpo":
        return None
    keys = a.gdpo_reward_keys or []
    missing = [k for k in keys if k not in rewards.extra]
    if missing:
        raise RuntimeError(
            f"gdpo: the reward function returned no {missing} (algorithm.gdpo_reward_keys); it returned "
            f"{sorted(rewards.extra) or 'a plain score'}: return a dict with a float for each key"
        )
    components_BK = torch.tensor([rewards.extra[k] for k in keys], dtype=torch.float32).T
    # A sample whose reward call failed has no components: it scores reward.error_score in each, as its
    # score does.
    return torch.nan_to_num(components_BK, nan=reward.error_score)
