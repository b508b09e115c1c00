"""An RL step's trainer-side math: the forward passes before the update and the update itself.

- micro_rows, mini_batches: the schedule, PPO epochs x mini-batches (one optimizer step each) x
  micro-batches; each mini-batch's units are counted over the role's ranks once (algos/aggregation.py).
- logprobs_of, values_of: no-grad passes over a rank's batch (old and reference logprobs, with the sum of
  squared probabilities the optimal token baseline reads; the critic's values).
- micro_batch_loss, update_policy: one micro-batch's policy loss (+ KL loss) (- entropy bonus), and the
  actor's whole update (UpdateResult).
- update_critic: the critic's clipped value loss over the same schedule.

A fork that changes the loss registers a policy loss (spmdrl/algos/policy_losses.py); one that changes
the update itself copies this file next to its recipe and imports its copy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from spmdrl.algos.aggregation import Aggregation, count_units_of_rows
from spmdrl.algos.config import AlgorithmConfig, TeacherConfig
from spmdrl.algos.distill import distill_estimate
from spmdrl.algos.kl import kl_penalty
from spmdrl.algos.policy_losses import POLICY_LOSSES, agg_mode_for
from spmdrl.algos.value_loss import clipped_value_loss
from spmdrl.derived import RLDerived
from spmdrl.distributed.reduce import all_reduce_sum, all_reduce_sum_tensors
from spmdrl.models import packing
from spmdrl.models.config import ModelConfig
from spmdrl.models.forward import attention_mask_for, packed_attention_mask, policy_forward
from spmdrl.models.grad_sync import defers_grad_sync, gradient_sync
from spmdrl.models.head import fused_chunk_for
from spmdrl.models.parallelize import gathered_through
from spmdrl.models.router_replay import RouterStats, RouterTap, moe_metrics, router_tap
from spmdrl.optim import clip_grad_norm
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.micro_batches import MicroBatch, micro_batch_rows, plan_micro_batches
from spmdrl.rl.models import Critic
from spmdrl.trainer_config import CriticConfig, OptimConfig, TrainerConfig


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """What the trainer's passes over the rows read of the job's config (the no-grad passes before the
    update and the update itself), gathered once by the job (spmdrl.rl.settings.update_settings)."""

    algorithm: AlgorithmConfig
    trainer: TrainerConfig  # pack_sequences, defer_grad_sync
    optim: OptimConfig  # the actor's: grad_clip, nonfinite_grad
    model: ModelConfig  # use_fused_kernels: the LM head the passes run
    # rollout.temperature: the logprobs are those of the distribution the engine sampled from.
    temperature: float
    # data.max_response_length: seq-mean-token-sum-norm's divisor when algorithm.loss_scale_factor is 0.
    max_response_length: int
    # The values of the config section the policy loss declared (its ``section``), None if it declared
    # none: resolved once, with the loss's name, where the settings are gathered.
    loss_section: Any = None
    # On-policy distillation (teacher.*): its loss term, when it is one (use_policy_gradient=false).
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)


def micro_rows(
    trainer: TrainerConfig, rl: RLDerived, batch: PolicyBatch, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """This rank's rows of ``batch`` per micro-batch of a no-grad pass (logprobs_of, values_of):
    rl.micro_batch_size sequences, or up to rl.log_prob_max_token_len tokens (the same number of
    micro-batches on every rank of ``group``). The update's are planned by :func:`mini_batches`."""
    return micro_batch_rows(
        batch.attention_mask_BT.sum(dim=1).cpu(),
        micro_batch_size=rl.micro_batch_size,
        token_budget=rl.log_prob_max_token_len,
        group=group,
        padded=not trainer.pack_sequences,
    )


@torch.no_grad()
def logprobs_of(
    model: torch.nn.Module,
    batch: PolicyBatch,
    parts: list[torch.Tensor],
    temperature: float,
    pack: bool = False,
    fused_chunk_tokens: int = 0,
) -> torch.Tensor:
    """A no-grad pass over the rank's batch, micro-batch by micro-batch (``parts``, see micro_rows):
    each token's logprob under ``model``, shape (B, T). ``fused_chunk_tokens``: policy_forward's (0: the
    plain LM head; spmdrl.models.head.fused_chunk_for gives model.use_fused_kernels' value)."""
    logprobs_BT, _ = logprobs_and_sum_pi_squared_of(
        model,
        batch,
        parts,
        temperature,
        pack,
        with_sum_pi_squared=False,
        fused_chunk_tokens=fused_chunk_tokens,
    )
    return logprobs_BT


@torch.no_grad()
def logprobs_and_sum_pi_squared_of(
    model: torch.nn.Module,
    batch: PolicyBatch,
    parts: list[torch.Tensor],
    temperature: float,
    pack: bool = False,
    with_sum_pi_squared: bool = True,
    fused_chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_of`, and (verl's actor.calculate_sum_pi_squared) the sum over the vocabulary of
    each predicting distribution's squared probabilities, (B, T): the optimal token baseline's input."""
    out_BT = torch.zeros_like(batch.engine_logprobs_BT)
    sps_BT = torch.zeros_like(batch.engine_logprobs_BT) if with_sum_pi_squared else None
    # Sizes read once, indices moved once: nothing inside the loop waits for the device.
    with gathered_through(model):  # a whole-model unit: gathered once for the pass
        for plan in plan_micro_batches(parts, batch.row_lengths(), out_BT.device):
            mb = batch.take(plan.index_B, plan.width)
            fwd = policy_forward(
                model,
                mb.input_ids_BT,
                mb.attention_mask_BT,
                temperature=temperature,
                with_sum_pi_squared=with_sum_pi_squared,
                pack_sequences=pack,
                first_column=plan.first_column,
                lengths_B=plan.lengths,
                first_columns_B=plan.first_columns,
                fused_chunk_tokens=fused_chunk_tokens,
                routed_experts_BTLK=mb.routed_experts_BTLK,
                images=mb.images,
            )
            out_BT[plan.index_B, : fwd.logprobs_BT.shape[1]] = fwd.logprobs_BT
            if sps_BT is not None and fwd.sum_pi_squared_BT is not None:
                sps_BT[plan.index_B, : fwd.sum_pi_squared_BT.shape[1]] = fwd.sum_pi_squared_BT
    return out_BT, sps_BT


@dataclasses.dataclass
class MicroBatchLoss:
    """One micro-batch's loss, the only tensor that holds its autograd graph, and detached by-products."""

    loss: torch.Tensor  # scalar to backpropagate
    logprobs_BT: torch.Tensor  # detached: the current policy's logprobs of the tokens
    stats: dict[str, torch.Tensor]  # detached scalars: pg_loss, entropy, pg_clipfrac, ppo_kl (+ kl_loss)


def _shifted_values(
    critic: torch.nn.Module, mb: PolicyBatch, pack: bool = False, lengths_B: list[int] | None = None
) -> torch.Tensor:
    """The critic's value of the state each token was sampled in, at the token's own position, (B, T).

    The output at position t sees tokens 0..t, the state before token t + 1 is sampled, so it is the
    value of token t + 1: shifted by one, as the logprobs are. ``lengths_B``: the rows' tokens on the
    host (policy_forward's: nothing is read from the device then).
    """
    if pack:
        p = packing.pack(mb.input_ids_BT, mb.attention_mask_BT, lengths_B=lengths_B)
        v_RC = critic(
            input_ids=p.input_ids_RC,
            position_ids=p.position_ids_RC,
            attention_mask=packed_attention_mask(critic, p.segment_ids_RC),
            use_cache=False,
        ).logits[..., 0]
        v_BT = p.unpack(v_RC.float())
    else:
        mask = attention_mask_for(critic, mb.attention_mask_BT, lengths_B)
        v_BT = critic(input_ids=mb.input_ids_BT, attention_mask=mask).logits[..., 0].float()
    out_BT = torch.zeros_like(mb.engine_logprobs_BT)
    out_BT[:, 1:] = v_BT[:, :-1]
    return out_BT


@torch.no_grad()
def values_of(
    critic: torch.nn.Module, batch: PolicyBatch, parts: list[torch.Tensor], pack: bool = False
) -> torch.Tensor:
    """A no-grad pass over the rank's batch: the critic's values (see _shifted_values), (B, T)."""
    out_BT = torch.zeros_like(batch.engine_logprobs_BT)
    with gathered_through(critic):
        for plan in plan_micro_batches(parts, batch.row_lengths(), out_BT.device):
            v_BT = _shifted_values(critic, batch.take(plan.index_B, plan.width), pack, plan.lengths)
            out_BT[plan.index_B, : v_BT.shape[1]] = v_BT
    return out_BT


def mini_batches(
    settings: UpdateSettings,
    rl: RLDerived,
    batch: PolicyBatch,
    modes: tuple[str, ...],
    group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[int, int, list[MicroBatch], list[PolicyBatch], tuple[Aggregation, ...]]]:
    """``(epoch, mini-batch, plan of each micro-batch, micro-batches, one aggregation per mode)`` for
    each optimizer step.

    Each mini-batch's units (tokens or sequences, per mode in ``modes``) are counted on all ranks with one
    all_reduce over the role's ``group``, for all mini-batches at once before the first runs: every loss
    term is its sum / that count (spmdrl/algos/aggregation.py). The actor's and the critic's updates walk
    the same schedule. seq-mean-token-sum-norm divides by algorithm.loss_scale_factor or
    data.max_response_length: verl's default is its response mask's width, which is the maximum response
    length (its rollout pads to it).

    The rows' sizes are read from the device once, here, and every micro-batch is planned from them on
    the host (the same plan every epoch): the loops over micro-batches read nothing from the device.
    """
    a = settings.algorithm
    norm_length = float(a.loss_scale_factor or settings.max_response_length)
    device = batch.input_ids_BT.device
    lengths = batch.row_lengths()
    per_mini = rl.per_rank_mini_batch_seqs
    plans = []
    local: dict[str, float] = {}
    for m in range(rl.mini_batches_per_step):
        lo = m * per_mini
        parts = micro_batch_rows(
            torch.tensor(lengths.tokens[lo : lo + per_mini], dtype=torch.long),
            micro_batch_size=rl.micro_batch_size,
            token_budget=rl.ppo_max_token_len,
            group=group,
            padded=not settings.trainer.pack_sequences,
        )
        plans.append(plan_micro_batches([lo + idx for idx in parts], lengths, device))
        rows = range(lo, lo + per_mini)
        for mode in set(modes):
            local[f"{m}/{mode}"] = count_units_of_rows(
                [lengths.response_tokens[i] for i in rows], mode, count_empty_rows=a.seq_mean_all_rows
            )
    counts = all_reduce_sum(local, device, group)
    for epoch in range(a.ppo_epochs):
        for m in range(rl.mini_batches_per_step):
            micro_batches = [batch.take(p.index_B, p.width) for p in plans[m]]
            yield (
                epoch,
                m,
                plans[m],
                micro_batches,
                tuple(Aggregation(mode, counts[f"{m}/{mode}"], norm_length) for mode in modes),
            )


def update_critic(
    settings: UpdateSettings,
    critic_cfg: CriticConfig,
    rl: RLDerived,
    critic: Critic,
    batch: PolicyBatch,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The clipped value loss towards the returns, over the same mini-batches and epochs as the actor
    (``settings``' schedule; ``critic_cfg``: the critic's clipping and optimizer, not the actor's)."""
    a = settings.algorithm
    assert batch.values_BT is not None and batch.returns_BT is not None
    sums = _DeviceSums()
    grad_norms = []
    defer = defers_grad_sync(critic.model, settings.trainer.defer_grad_sync)
    for _, _, plans, micro_batches, (agg,) in mini_batches(settings, rl, batch, (a.loss_agg_mode,), group):
        for i, (plan, mb) in enumerate(zip(plans, micro_batches, strict=True)):
            gradient_sync(critic.model, defer, last=i == len(micro_batches) - 1)
            values_BT = _shifted_values(critic.model, mb, settings.trainer.pack_sequences, plan.lengths)
            assert mb.values_BT is not None and mb.returns_BT is not None
            loss, stats = clipped_value_loss(
                values_BT,
                mb.values_BT,
                mb.returns_BT,
                mb.response_mask_BT,
                agg=agg,
                cliprange=critic_cfg.cliprange_value,
            )
            loss.backward()
            sums.add("vf_loss", loss)
            for k, v in stats.items():
                sums.add(k, v, len(micro_batches))
        grad_norm = clip_grad_norm(critic.model, critic_cfg.optim.grad_clip)
        if not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite critic gradient norm; try a lower critic.optim.lr (now {critic_cfg.optim.lr})"
            )
        grad_norms.append(grad_norm)
        critic.optimizer.step()
        critic.optimizer.zero_grad(set_to_none=True)
    critic.scheduler.step()
    updates = a.ppo_epochs * rl.mini_batches_per_step
    reduced = sums.all_reduce(group)
    world = dist.get_world_size(group)
    metrics = {f"critic/{k}": v / updates / (1 if k == "vf_loss" else world) for k, v in reduced.items()}
    metrics["critic/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["critic/lr"] = critic.scheduler.get_last_lr()[0]
    return metrics


def routing_metrics(
    tap: RouterTap, group: dist.ProcessGroup | None, device: torch.device
) -> dict[str, float]:
    """``moe/*`` of the forwards since the tap's last take, over ``group``'s ranks (one all_reduce)."""
    stats = tap.take_stats()
    if stats is None:  # no forward on this rank: zeros, so that the reduction still matches the others'
        stats = RouterStats.zeros(tap.num_layers, tap.num_experts, device)
    t = stats.tensors()
    flat = torch.cat([v.reshape(-1).to(device, torch.float64) for v in t.values()])
    if dist.is_initialized():
        dist.all_reduce(flat, group=group)
    sums, at = {}, 0
    for k, v in t.items():
        sums[k] = flat[at : at + v.numel()].view(v.shape)
        at += v.numel()
    return moe_metrics(sums)


def policy_loss_name(algo: AlgorithmConfig) -> str:
    """algorithm.policy_loss, or bypass_mode when the rollout correction runs in bypass mode (verl's
    apply_bypass_mode sets the loss mode so)."""
    return "bypass_mode" if algo.rollout_correction.bypass_mode else algo.policy_loss


def loss_modes(algo: AlgorithmConfig) -> tuple[str, str]:
    """``(policy term's mode, entropy and KL terms' mode)``: algorithm.loss_agg_mode for both, except the
    policy term of sapo and geo_mean, which verl reduces with a mode of its own (agg_mode_for)."""
    return agg_mode_for(policy_loss_name(algo), algo.loss_agg_mode), algo.loss_agg_mode


def micro_batch_loss(
    settings: UpdateSettings,
    actor: torch.nn.Module,
    mb: PolicyBatch,
    agg: Aggregation,
    pg_agg: Aggregation | None = None,
    plan: MicroBatch | None = None,
) -> MicroBatchLoss:
    """Policy loss (+ KL loss) (- entropy bonus) of one micro-batch: each term ``agg(per-token term)``,
    the policy term ``pg_agg(...)`` when given (sapo and geo_mean reduce theirs by a mode of their own,
    see agg_mode_for; the entropy and KL terms keep algorithm.loss_agg_mode, as in verl).

    ``mb.old_logprobs_BT`` None is the on-policy single update: the policy before the step *is* the
    current one. The entropy gets a gradient only when it enters the loss (algorithm.entropy_coeff > 0);
    as a mere metric it is computed without one, since its graph would keep a B x T x V float32 softmax
    alive.

    ``plan``: the micro-batch's host-side sizes (mini_batches plans them); without one, its first
    response column is read from the device (a sync on a GPU), and so is its count of valid tokens by a
    loss that declared ``valid_count`` (clip_cov, kl_cov).
    """
    a = settings.algorithm
    entropy_in_loss = a.entropy_coeff > 0
    aux_coef = settings.model.router_aux_loss_coef
    fwd = policy_forward(
        actor,
        mb.input_ids_BT,
        mb.attention_mask_BT,
        temperature=settings.temperature,
        with_entropy=True,
        entropy_grad=entropy_in_loss,
        pack_sequences=settings.trainer.pack_sequences,
        first_column=mb.first_response_column() if plan is None else plan.first_column,
        lengths_B=None if plan is None else plan.lengths,
        first_columns_B=None if plan is None else plan.first_columns,
        fused_chunk_tokens=fused_chunk_for(settings.model, actor),
        routed_experts_BTLK=mb.routed_experts_BTLK,
        router_aux_grad=aux_coef > 0,
        images=mb.images,
    )
    lp_BT, ent_BT = fwd.logprobs_BT, fwd.entropy_BT
    assert ent_BT is not None
    mask_BT = mb.response_mask_BT
    if a.rollout_correction.bypass_mode:  # verl's apply_bypass_mode: old_log_probs = rollout_log_probs
        old_BT = mb.engine_logprobs_BT
    else:
        old_BT = mb.old_logprobs_BT if mb.old_logprobs_BT is not None else lp_BT.detach()
    loss_fn = POLICY_LOSSES.get(policy_loss_name(a))
    # A loss that declared a config section of its own also gets its values (settings.loss_section).
    own: dict[str, object] = {}
    if loss_fn.section is not None:
        assert settings.loss_section is not None, "update_settings resolves the loss's section"
        own["section"] = settings.loss_section
    if loss_fn.valid_count:
        # mask_BT's ones, counted on the host from the rows' lengths (the mask the plan was made from:
        # the rollout correction's rejection edits the batch's mask before the update plans it).
        own["num_valid_tokens"] = None if plan is None else plan.response_tokens
    pg = loss_fn.fn(
        lp_BT,
        old_BT,
        mb.advantages_BT,
        mask_BT,
        agg=pg_agg or agg,
        params=a,  # the algorithm section: every loss parameter and its default
        is_weights_BT=mb.is_weights_BT,
        **own,
    )
    loss = pg.loss
    stats = {"pg_loss": pg.loss.detach(), **pg.metrics}
    if a.use_kl_loss:
        assert mb.ref_logprobs_BT is not None
        kl_loss = agg(kl_penalty(lp_BT, mb.ref_logprobs_BT, a.kl_loss_type), mask_BT)
        loss = loss + a.kl_loss_coef * kl_loss
        stats["kl_loss"] = kl_loss.detach()
    if aux_coef > 0 and fwd.router_aux_loss is not None:
        # model.router_aux_loss_coef: transformers' load-balancing loss of this micro-batch's routing, added
        # as transformers adds it (coef x loss per forward); one term per micro-batch, like the forward's.
        loss = loss + aux_coef * fwd.router_aux_loss
    t = settings.teacher
    if t.enabled and not t.use_policy_gradient:  # the distillation as a loss term (spmdrl.algos.distill)
        assert mb.teacher_logprobs_BT is not None
        distill_loss = agg(distill_estimate(t, lp_BT, mb.teacher_logprobs_BT), mask_BT)
        loss = loss + t.coef * distill_loss
        stats["distill_loss"] = distill_loss.detach()
    ent_loss = agg(ent_BT, mask_BT)
    if entropy_in_loss:
        loss = loss - a.entropy_coeff * ent_loss
    stats["entropy"] = ent_loss.detach()
    return MicroBatchLoss(loss=loss, logprobs_BT=lp_BT.detach(), stats=stats)


@dataclasses.dataclass
class UpdateResult:
    metrics: dict[str, float]
    # The policy's logprobs before this update (recomputed, or from the first epoch's forward).
    old_logprobs_BT: torch.Tensor


class _DeviceSums:
    """Per-micro-batch statistics summed on the device, read on the host once, after the loop.

    ``float(v)`` per statistic per micro-batch was a sync each on a GPU. The sums are float64, as the
    Python floats they replace, and add the same values in the same order, so the metrics are the same
    to the last bit.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor, divisor: int = 1) -> None:
        term = value.detach().double()
        if divisor != 1:
            term = term / divisor
        self.sums[key] = term if key not in self.sums else self.sums[key] + term

    def all_reduce(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Every sum added over ``group``'s ranks: one all_reduce and one read."""
        return all_reduce_sum_tensors(self.sums, group)


# Summed over micro-batches and ranks, these are the mini-batch's loss terms (each micro-batch is already
# divided by the mini-batch's global count); the others are micro-batch means, averaged.
_SUMMED = ("pg_loss", "kl_loss", "distill_loss", "entropy")


def update_policy(
    settings: UpdateSettings,
    rl: RLDerived,
    actor: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PolicyBatch,
    group: dist.ProcessGroup | None = None,
) -> UpdateResult:
    """PPO epochs x mini-batches; each mini-batch is one optimizer step over its micro-batches.

    Every loss term is (this rank's sum) / (the mini-batch's count of tokens or sequences on all
    ranks), counted once per mini-batch with one all_reduce, and FSDP sums the gradients over ranks:
    the gradient of the whole mini-batch's loss, however it is split (spmdrl/algos/aggregation.py).
    """
    a = settings.algorithm
    modes = loss_modes(a)
    old_BT = batch.old_logprobs_BT.clone() if batch.old_logprobs_BT is not None else None
    captured_BT = torch.zeros_like(batch.engine_logprobs_BT)
    tap = router_tap(actor)
    if tap is not None:
        tap.take_stats()  # the routing statistics of this update's forwards only
    sums = _DeviceSums()
    grad_norms, skipped = [], 0
    defer = defers_grad_sync(actor, settings.trainer.defer_grad_sync)
    for epoch, m, plans, micro_batches, (pg_agg, agg) in mini_batches(settings, rl, batch, modes, group):
        for i, (plan, mb) in enumerate(zip(plans, micro_batches, strict=True)):
            gradient_sync(actor, defer, last=i == len(micro_batches) - 1)
            out = micro_batch_loss(settings, actor, mb, agg, pg_agg, plan)
            if old_BT is None and epoch == 0:  # on-policy: this forward is the old policy
                captured_BT[plan.index_B, : out.logprobs_BT.shape[1]] = out.logprobs_BT
            out.loss.backward()
            for k, v in out.stats.items():
                sums.add(k, v, 1 if k in _SUMMED else len(micro_batches))
            # The last reference to this micro-batch's graph: dropped before the next forward, not
            # when `out` is reassigned after it, so no part of it can add to the next one's peak.
            del out
        optim = settings.optim
        grad_norm = clip_grad_norm(actor, optim.grad_clip)
        if not math.isfinite(grad_norm):
            if optim.nonfinite_grad == "stop":
                raise FloatingPointError(
                    f"non-finite gradient norm in PPO epoch {epoch} mini-batch {m}; try a lower "
                    f"optim.lr (now {optim.lr}), check the rewards, or set optim.nonfinite_grad=skip"
                )
            skipped += 1  # verl's behaviour: drop this update, keep training
            optimizer.zero_grad(set_to_none=True)
            continue
        grad_norms.append(grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    updates = a.ppo_epochs * rl.mini_batches_per_step
    reduced = sums.all_reduce(group)
    world = dist.get_world_size(group)
    metrics = {f"actor/{k}": v / updates / (1 if k in _SUMMED else world) for k, v in reduced.items()}
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["actor/skipped_updates"] = skipped
    if tap is not None:
        metrics.update(routing_metrics(tap, group, batch.engine_logprobs_BT.device))
    return UpdateResult(metrics, old_BT if old_BT is not None else captured_BT)
