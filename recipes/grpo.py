"""GRPO as one SPMD program. Read it top to bottom: it is the step in docs/architecture.md.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=grpo_tiny

Every rank, every step:
  1. rollout    its shard of the prompts -> rollout.n samples each, from the in-process vLLM engine
  2. reward     rule / user reward functions on its own samples (sandboxed, with a timeout)
  3. batch      rows + advantages (algorithm.adv_estimator); a rank holds whole groups: no communication
  4. old, ref   the trainer's and the reference model's logprobs of the sampled tokens
  5. update     policy loss (algorithm.policy_loss) + KL loss, mini-batches x micro-batches; every term
                is sum / (the mini-batch's global count) and FSDP sums gradients (algos/aggregation.py)
  6. sync       the actor's FSDP2 shards -> full tensors per bucket -> the engine, in place
  7. log        metrics (reduced over ranks), samples, validation, curves

With algorithm.adv_estimator=gae it is PPO: a critic (value head on the actor's backbone) is built, gives
the values GAE needs in step 3 and trains towards the returns in step 5 (recipe=ppo_tiny). With
parallel.placement=split the actor and the critic live on different ranks: the rows move to each role's
ranks (plan_rows), the values to the actor, the returns to the critic, the two updates run at the same
time, and the critic's ranks receive the actor's weights for their engines (docs/architecture.md).

Checkpoints (spmdrl/checkpoint/checkpointer.py) every trainer.save_every steps and after the last; a run
resumes from the newest complete one in its output directory (trainer.resume=auto), exactly.

Deliberately simple: no sequence packing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spmdrl.algos.advantages import (
    NEEDS_BASELINE,
    NEEDS_CRITIC,
    AdvantageInputs,
    compute_advantages,
    token_level_rewards,
)
from spmdrl.algos.aggregation import Aggregation, count_units
from spmdrl.algos.batch import PolicyBatch, build_policy_batch
from spmdrl.algos.correction import rollout_correction
from spmdrl.algos.dapo import (
    dynamic_sampling_metrics,
    groups_with_signal,
    overlong_penalty,
    should_generate_more,
)
from spmdrl.algos.kl import kl_penalty
from spmdrl.algos.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)
from spmdrl.algos.micro_batches import micro_batch_rows
from spmdrl.algos.policy_losses import PolicyLossParams, agg_mode_for, policy_loss
from spmdrl.algos.value_loss import clipped_value_loss
from spmdrl.checkpoint.checkpointer import (
    Checkpointer,
    RoleState,
    checkpoint_root,
    load_checkpoint,
    plan_resume,
)
from spmdrl.checkpoint.export import write_hf_metadata
from spmdrl.config import Config, ConfigError, RLDerived, derive, derive_rl
from spmdrl.data.prompts import PromptDataset, PromptExample
from spmdrl.data.sampler import DistributedSampler
from spmdrl.data.tiny_task import resolve_data_files
from spmdrl.distributed.env import broadcast_object, broadcast_str
from spmdrl.distributed.placement import Meshes, plan_placement
from spmdrl.distributed.reduce import all_reduce_max, all_reduce_min, all_reduce_sum
from spmdrl.distributed.role_rows import plan_rows
from spmdrl.distributed.topology import check_tp_within_nodes, node_layout_from_env
from spmdrl.logging.metrics import truncate_after
from spmdrl.logging.plot import plot_curves
from spmdrl.logging.samples import Sample, write_samples
from spmdrl.logging.timer import PhaseTimer
from spmdrl.models import packing
from spmdrl.models.build import build_fsdp_model, build_meta_model, model_spec
from spmdrl.models.forward import policy_logprobs
from spmdrl.models.load import load_tokenizer, resolve_model_path_all_ranks
from spmdrl.optim import build_lr_scheduler, build_optimizer, clip_grad_norm, optimizer_state_on
from spmdrl.rewards.registry import RewardInput, check_data_sources, load_reward_fn
from spmdrl.rewards.sandbox import RewardResult, score_batch
from spmdrl.rollout.engine import (
    Generation,
    SamplingSpec,
    build_engine,
    check_engine_config,
)
from spmdrl.rollout.mismatch import logprob_mismatch
from spmdrl.rollout.rollout import Rollout, build_agent_loop, load_multi_turn_tools
from spmdrl.rollout.weight_sync import Fanout, SyncCheck, sync_weights
from spmdrl.runtime import Run, restart_count, start_run
from spmdrl.tools import tool_schemas

log = logging.getLogger("spmdrl")

CURVE_KEYS = ["rollout/reward_mean", "val/accuracy"]


# ----------------------------------------------------------------------------------------- set-up
def warmstart_config(cfg: Config) -> Config:
    """The SFT stage's config: the RL config with the warm-start's optimizer and batch settings."""
    ws = cfg.warmstart
    return dataclasses.replace(
        cfg,
        optim=ws.optim,
        trainer=dataclasses.replace(
            cfg.trainer,
            total_steps=ws.total_steps,
            global_batch_size=ws.global_batch_size,
            micro_batch_size=ws.micro_batch_size,
            val_every=0,
            save_hf=True,
        ),
    )


def load_prompts(
    run: Run, tokenizer: object, files: list[str], tools: list[dict[str, Any]] | None = None
) -> PromptDataset:
    d = run.cfg.data
    return PromptDataset(
        resolve_data_files(files, run.cache_dir, d.tiny, d.tiny_tools),
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        overlong=d.overlong,
        tools=tools,
    )


# ------------------------------------------------------------------------------------ the pieces
def score(
    cfg: Config, reward_fn: object, tokenizer: object, prompts: list[PromptExample], gens: list[Generation]
) -> tuple[RewardResult, list[str]]:
    responses = tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)  # type: ignore[attr-defined]
    inputs = [
        RewardInput(
            response=r,
            ground_truth=prompts[g.prompt_index].ground_truth,
            data_source=prompts[g.prompt_index].data_source,
            # A multi-turn reward also sees how the trajectory went (turns, tool calls and errors).
            extra_info=prompts[g.prompt_index].extra_info
            if g.trajectory is None
            else {**prompts[g.prompt_index].extra_info, **g.trajectory.as_extra_info()},
        )
        for r, g in zip(responses, gens, strict=True)
    ]
    rc = cfg.reward
    result = score_batch(
        reward_fn,  # type: ignore[arg-type]
        inputs,
        timeout_s=rc.timeout_s,
        error_score=rc.error_score,
        batch_timeout_s=rc.batch_timeout_s,
        memory_mb=rc.worker_memory_mb,
        file_size_mb=rc.worker_file_size_mb,
    )
    return result, responses


def micro_rows(
    cfg: Config, rl: RLDerived, batch: PolicyBatch, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """This rank's rows of ``batch`` per micro-batch: rl.micro_batch_size sequences, or up to
    trainer.micro_batch_tokens tokens (the same number of micro-batches on every rank of ``group``)."""
    return micro_batch_rows(
        batch.attention_mask_BT.sum(dim=1).cpu(),
        micro_batch_size=rl.micro_batch_size,
        token_budget=cfg.trainer.micro_batch_tokens,
        group=group,
    )


@torch.no_grad()
def logprobs_of(
    model: torch.nn.Module,
    batch: PolicyBatch,
    parts: list[torch.Tensor],
    temperature: float,
    pack: bool = False,
) -> torch.Tensor:
    """A no-grad pass over the rank's batch, micro-batch by micro-batch (``parts``, see micro_rows):
    each token's logprob under ``model``, shape (B, T)."""
    out_BT = torch.zeros_like(batch.engine_logprobs_BT)
    for idx in parts:
        mb = batch.take(idx)
        lp_BT, _ = policy_logprobs(
            model,
            mb.input_ids_BT,
            mb.attention_mask_BT,
            temperature=temperature,
            pack_sequences=pack,
            first_column=mb.first_response_column(),
        )
        out_BT[idx.to(out_BT.device), : lp_BT.shape[1]] = lp_BT
    return out_BT


@dataclasses.dataclass
class MicroBatchLoss:
    """One micro-batch's loss, the only tensor that holds its autograd graph, and detached by-products."""

    loss: torch.Tensor  # scalar to backpropagate
    logprobs_BT: torch.Tensor  # detached: the current policy's logprobs of the tokens
    stats: dict[str, torch.Tensor]  # detached scalars: pg_loss, entropy, pg_clipfrac, ppo_kl (+ kl_loss)


def build_models(
    cfg: Config, device: torch.device, meshes: Meshes, model_dir: Path
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The actor (trained) and, when a KL term needs it, the frozen reference, FSDP2 on the actor's ranks.

    A rank that does not hold the actor (split placement) gets a meta-device copy of it instead: the
    names and shapes it receives the actor's weights by (weight_sync.Fanout), no memory, no reference.
    """
    a = cfg.algorithm
    if not meshes.holds("actor"):
        return build_meta_model(model_spec(cfg.model, model_dir, device, train=False)), None
    actor = build_fsdp_model(
        model_spec(cfg.model, model_dir, device, train=True), meshes.fsdp("actor"), device
    )
    ref = None
    if a.use_kl_loss or a.use_kl_in_reward:
        ref = build_fsdp_model(
            model_spec(cfg.model, model_dir, device, train=False), meshes.fsdp("ref"), device
        )
    elif cfg.model.offload_ref:
        log.warning("model.offload_ref=true does nothing here: no KL term, so no reference model is built")
    return actor, ref


@dataclasses.dataclass
class Critic:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def build_critic(
    cfg: Config, device: torch.device, meshes: Meshes, actor_dir: Path, cache_dir: Path
) -> Critic:
    """The value model (FSDP2 like the actor, on the critic's ranks), its optimizer and schedule."""
    path = (
        resolve_model_path_all_ranks(cfg.critic.model_path, cache_dir) if cfg.critic.model_path else actor_dir
    )
    spec = model_spec(cfg.model, path, device, train=True, head="value")
    model = build_fsdp_model(spec, meshes.fsdp("critic"), device)
    optimizer = build_optimizer(model, cfg.critic.optim)
    return Critic(
        model, optimizer, build_lr_scheduler(optimizer, cfg.critic.optim, cfg.trainer.total_steps or 1)
    )


def _shifted_values(critic: torch.nn.Module, mb: PolicyBatch, pack: bool = False) -> torch.Tensor:
    """The critic's value of the state each token was sampled in, at the token's own position, (B, T).

    The output at position t sees tokens 0..t, the state before token t + 1 is sampled, so it is the
    value of token t + 1: shifted by one, as the logprobs are.
    """
    if pack:
        p = packing.pack(mb.input_ids_BT, mb.attention_mask_BT)
        v_RC = critic(input_ids=p.input_ids_RC, position_ids=p.position_ids_RC, use_cache=False).logits[
            ..., 0
        ]
        v_BT = p.unpack(v_RC.float())
    else:
        v_BT = critic(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits[..., 0].float()
    out_BT = torch.zeros_like(mb.engine_logprobs_BT)
    out_BT[:, 1:] = v_BT[:, :-1]
    return out_BT


@torch.no_grad()
def values_of(
    critic: torch.nn.Module, batch: PolicyBatch, parts: list[torch.Tensor], pack: bool = False
) -> torch.Tensor:
    """A no-grad pass over the rank's batch: the critic's values (see _shifted_values), (B, T)."""
    out_BT = torch.zeros_like(batch.engine_logprobs_BT)
    for idx in parts:
        v_BT = _shifted_values(critic, batch.take(idx), pack)
        out_BT[idx.to(out_BT.device), : v_BT.shape[1]] = v_BT
    return out_BT


def mini_batches(
    cfg: Config, rl: RLDerived, batch: PolicyBatch, mode: str, group: dist.ProcessGroup | None = None
) -> Iterator[tuple[int, int, list[torch.Tensor], list[PolicyBatch], Aggregation]]:
    """``(epoch, mini-batch, rows of each micro-batch, micro-batches, aggregation)`` for each optimizer step.

    Each mini-batch's units (tokens or sequences, per ``mode``) are counted on all ranks with one
    all_reduce over the role's ``group`` before its micro-batches run: every loss term is its sum / that
    count (spmdrl/algos/aggregation.py). The actor's and the critic's updates walk the same schedule.
    """
    a = cfg.algorithm
    norm_length = float(a.loss_scale_factor or cfg.data.max_response_length)
    device = batch.input_ids_BT.device
    for epoch in range(a.ppo_epochs):
        for m in range(rl.mini_batches_per_step):
            lo = m * rl.per_rank_mini_batch_seqs
            rows = [
                lo + idx
                for idx in micro_rows(cfg, rl, batch.rows(lo, lo + rl.per_rank_mini_batch_seqs), group)
            ]
            micro_batches = [batch.take(idx) for idx in rows]
            local = sum(count_units(mb.response_mask_BT, mode) for mb in micro_batches)
            yield (
                epoch,
                m,
                rows,
                micro_batches,
                Aggregation(mode, all_reduce_sum({"n": local}, device, group)["n"], norm_length),
            )


def update_critic(
    cfg: Config, rl: RLDerived, critic: Critic, batch: PolicyBatch, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """The clipped value loss towards the returns, over the same mini-batches and epochs as the actor."""
    a = cfg.algorithm
    assert batch.values_BT is not None and batch.returns_BT is not None
    device = batch.input_ids_BT.device
    sums: dict[str, float] = defaultdict(float)
    grad_norms = []
    for _, _, _, micro_batches, agg in mini_batches(cfg, rl, batch, a.loss_agg_mode, group):
        for mb in micro_batches:
            values_BT = _shifted_values(critic.model, mb, cfg.trainer.pack_sequences)
            assert mb.values_BT is not None and mb.returns_BT is not None
            loss, stats = clipped_value_loss(
                values_BT,
                mb.values_BT,
                mb.returns_BT,
                mb.response_mask_BT,
                agg=agg,
                cliprange=cfg.critic.cliprange_value,
            )
            loss.backward()
            sums["vf_loss"] += float(loss.detach())
            for k, v in stats.items():
                sums[k] += float(v) / len(micro_batches)
        grad_norm = clip_grad_norm(critic.model, cfg.critic.optim.grad_clip)
        if not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite critic gradient norm; try a lower critic.optim.lr (now {cfg.critic.optim.lr})"
            )
        grad_norms.append(grad_norm)
        critic.optimizer.step()
        critic.optimizer.zero_grad(set_to_none=True)
    critic.scheduler.step()
    updates = a.ppo_epochs * rl.mini_batches_per_step
    reduced = all_reduce_sum(dict(sums), device, group)
    world = dist.get_world_size(group)
    metrics = {f"critic/{k}": v / updates / (1 if k == "vf_loss" else world) for k, v in reduced.items()}
    metrics["critic/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["critic/lr"] = critic.scheduler.get_last_lr()[0]
    return metrics


def loss_params(cfg: Config) -> PolicyLossParams:
    """The policy loss's parameters: the algorithm config's fields of the same (verl's) names."""
    return PolicyLossParams(
        **{f.name: getattr(cfg.algorithm, f.name) for f in dataclasses.fields(PolicyLossParams)}
    )


def micro_batch_loss(
    cfg: Config, actor: torch.nn.Module, mb: PolicyBatch, agg: Aggregation
) -> MicroBatchLoss:
    """Policy loss (+ KL loss) (- entropy bonus) of one micro-batch: each term ``agg(per-token term)``.

    ``mb.old_logprobs_BT`` None is the on-policy single update: the policy before the step *is* the
    current one. The entropy gets a gradient only when it enters the loss (algorithm.entropy_coeff > 0);
    as a mere metric it is computed without one, since its graph would keep a B x T x V float32 softmax
    alive.
    """
    a = cfg.algorithm
    entropy_in_loss = a.entropy_coeff > 0
    lp_BT, ent_BT = policy_logprobs(
        actor,
        mb.input_ids_BT,
        mb.attention_mask_BT,
        temperature=cfg.rollout.temperature,
        with_entropy=True,
        entropy_grad=entropy_in_loss,
        pack_sequences=cfg.trainer.pack_sequences,
        first_column=mb.first_response_column(),
    )
    assert ent_BT is not None
    mask_BT = mb.response_mask_BT
    old_BT = mb.old_logprobs_BT if mb.old_logprobs_BT is not None else lp_BT.detach()
    pg = policy_loss(a.policy_loss)(
        lp_BT,
        old_BT,
        mb.advantages_BT,
        mask_BT,
        agg=agg,
        params=loss_params(cfg),
        is_weights_BT=mb.is_weights_BT,
    )
    loss = pg.loss
    stats = {"pg_loss": pg.loss.detach(), **pg.metrics}
    if a.use_kl_loss:
        assert mb.ref_logprobs_BT is not None
        kl_loss = agg(kl_penalty(lp_BT, mb.ref_logprobs_BT, a.kl_loss_type), mask_BT)
        loss = loss + a.kl_loss_coef * kl_loss
        stats["kl_loss"] = kl_loss.detach()
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


# Summed over micro-batches and ranks, these are the mini-batch's loss terms (each micro-batch is already
# divided by the mini-batch's global count); the others are micro-batch means, averaged.
_SUMMED = ("pg_loss", "kl_loss", "entropy")


def update_policy(
    cfg: Config,
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
    a = cfg.algorithm
    device = batch.input_ids_BT.device
    # gspo, sapo, geo_mean reduce per sequence, as in verl.
    mode = agg_mode_for(a.policy_loss, a.loss_agg_mode)
    old_BT = batch.old_logprobs_BT.clone() if batch.old_logprobs_BT is not None else None
    captured_BT = torch.zeros_like(batch.engine_logprobs_BT)
    sums: dict[str, float] = defaultdict(float)
    grad_norms, skipped = [], 0
    for epoch, m, rows, micro_batches, agg in mini_batches(cfg, rl, batch, mode, group):
        for idx, mb in zip(rows, micro_batches, strict=True):
            out = micro_batch_loss(cfg, actor, mb, agg)
            if old_BT is None and epoch == 0:  # on-policy: this forward is the old policy
                captured_BT[idx.to(captured_BT.device), : out.logprobs_BT.shape[1]] = out.logprobs_BT
            out.loss.backward()
            for k, v in out.stats.items():
                sums[k] += float(v) if k in _SUMMED else float(v) / len(micro_batches)
            # The last reference to this micro-batch's graph: dropped before the next forward, not
            # when `out` is reassigned after it, so no part of it can add to the next one's peak.
            del out
        grad_norm = clip_grad_norm(actor, cfg.optim.grad_clip)
        if not math.isfinite(grad_norm):
            if cfg.optim.nonfinite_grad == "stop":
                raise FloatingPointError(
                    f"non-finite gradient norm in PPO epoch {epoch} mini-batch {m}; try a lower "
                    f"optim.lr (now {cfg.optim.lr}), check the rewards, or set optim.nonfinite_grad=skip"
                )
            skipped += 1  # verl's behaviour: drop this update, keep training
            optimizer.zero_grad(set_to_none=True)
            continue
        grad_norms.append(grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    updates = a.ppo_epochs * rl.mini_batches_per_step
    reduced = all_reduce_sum(dict(sums), device, group)
    world = dist.get_world_size(group)
    metrics = {f"actor/{k}": v / updates / (1 if k in _SUMMED else world) for k, v in reduced.items()}
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["actor/skipped_updates"] = skipped
    return UpdateResult(metrics, old_BT if old_BT is not None else captured_BT)


# Every phase a step may time. Ranks report the same keys (0 where a phase did not run on them: under a
# split placement the actor's and the critic's ranks run different phases).
PHASES = (
    "rollout",
    "reward",
    "exchange",
    "old_ref",
    "values",
    "critic_update",
    "actor_update",
    "update",
    "weight_sync",
    "weight_sync_check",
)


def host_peak_memory_gb() -> float:
    """This process's peak resident set since it started, in GiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """This rank's peak memory since it started, in GiB: ``memory_gb`` is the CUDA allocator's peak on a
    GPU, the process's peak resident set on CPU (model, optimizer, engine and its KV cache together); on a
    GPU ``host_memory_gb`` is the resident set too (where offloaded state goes)."""
    if device.type == "cuda":
        return {
            "memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "host_memory_gb": host_peak_memory_gb(),
        }
    return {"memory_gb": host_peak_memory_gb()}


def step_metrics(
    cfg: Config,
    ro: Rollouts,
    timer: PhaseTimer,
    device: torch.device,
    actor_part: tuple[PolicyBatch, torch.Tensor, torch.Tensor] | None,
    actor_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Rollout, reward and timing metrics of the step reduced over all ranks, and, on the actor's ranks
    (``actor_part``: its batch, the sampled mask and the old logprobs), the trainer-vs-engine mismatch
    and training speed reduced over the actor's group.

    The mismatch is measured on every sampled token (the sampled mask, before rejection masked any).
    """
    n, gens, scores_B = cfg.rollout.n, ro.gens, ro.rewards.scores_B
    sums = all_reduce_sum(
        {
            "reward": float(scores_B.sum()),
            "reward_sq": float((scores_B**2).sum()),
            "n": len(gens),
            "tokens": sum(len(g.token_ids) for g in gens),
            "truncated": sum(g.finish_reason == "length" for g in gens),
            "errors": ro.rewards.num_errors,
            "timeouts": ro.rewards.num_timeouts,
            "solved_groups": float((scores_B.view(-1, n).min(dim=1).values >= 1.0).sum()),
        },
        device,
    )
    # A step is as slow as its slowest rank; phases no rank ran are left out.
    seconds = {f"{p}_s": timer.seconds.get(f"{p}_s", 0.0) for p in PHASES}
    peaks = all_reduce_max({**seconds, **peak_memory_gb(device)}, device)
    memory_gb = peaks.pop("memory_gb")
    host_memory_gb = peaks.pop("host_memory_gb", None)
    slowest = {k: v for k, v in peaks.items() if v > 0}
    count = sums["n"]
    mean = sums["reward"] / count
    metrics = {
        "rollout/reward_mean": mean,
        "rollout/reward_std": math.sqrt(max(sums["reward_sq"] / count - mean**2, 0.0)),
        "rollout/response_len_mean": sums["tokens"] / count,
        # Responses cut at data.max_response_length (verl: response_length/clip_ratio).
        "rollout/truncated_frac": sums["truncated"] / count,
        "rollout/solved_group_frac": sums["solved_groups"] / (count / n),
        # Every sample that did not get a real score: raised, bad value, or past the timeout.
        "reward/errors": sums["errors"] + sums["timeouts"],
        "reward/timeouts": sums["timeouts"],
        **ro.metrics,
        "perf/rollout_tokens_per_s": sums["tokens"] / max(slowest.get("rollout_s", 0.0), 1e-9),
        # The largest rank's peak so far: resident memory on CPU, the allocator's peak on GPU.
        "perf/max_memory_gb": memory_gb,
        **({} if host_memory_gb is None else {"perf/max_host_memory_gb": host_memory_gb}),
        **{f"timing/{k}": v for k, v in slowest.items()},
    }
    if "critic_update_s" in slowest and "actor_update_s" in slowest:
        # 1.0 when the two updates run one after the other (colocated), up to 2.0 fully side by side.
        metrics["perf/update_overlap"] = (slowest["actor_update_s"] + slowest["critic_update_s"]) / max(
            slowest.get("update_s", 0.0), 1e-9
        )
    if actor_part is not None:
        batch, sampled_mask_BT, old_logprobs_BT = actor_part
        mismatch = logprob_mismatch(
            old_logprobs_BT, batch.engine_logprobs_BT, sampled_mask_BT, group=actor_group or dist.group.WORLD
        )
        tokens = float(batch.attention_mask_BT.sum()) * cfg.algorithm.ppo_epochs
        train_tokens = all_reduce_sum({"t": tokens}, device, actor_group)["t"]
        metrics.update(
            {f"mismatch/{k}": mismatch[k] for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3")}
        )
        metrics["perf/train_tokens_per_s"] = train_tokens / max(slowest.get("actor_update_s", 0.0), 1e-9)
    return metrics


def advantage_estimator(
    cfg: Config, num_prompts: int, baseline_B: torch.Tensor | None, values_BT: torch.Tensor | None = None
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """algorithm.adv_estimator over this rank's rows (rollout.n consecutive samples per prompt):
    ``(token_rewards_BT, response_mask_BT) -> (advantages_BT, returns_BT)``."""
    a = cfg.algorithm

    def advantages(
        token_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = AdvantageInputs(
            token_rewards_BT,
            response_mask_BT,
            group_ids_B=torch.arange(num_prompts).repeat_interleave(cfg.rollout.n),
            values_BT=values_BT,
            baseline_B=baseline_B,
            gamma=a.gamma,
            lam=a.lam,
            norm_by_std=a.norm_adv_by_std,
        )
        return compute_advantages(a.adv_estimator, inputs)

    return advantages


@dataclasses.dataclass
class Rollouts:
    """A step's samples on this rank: rollout.n per prompt, grouped by prompt, with their rewards."""

    prompts: list[PromptExample]
    gens: list[Generation]
    rewards: RewardResult
    responses: list[str]
    metrics: dict[str, float]


def rollout_and_score(
    cfg: Config,
    rollout: Rollout,
    sampler: DistributedSampler,
    train_ds: PromptDataset,
    tokenizer: object,
    reward_fn: object,
    step: int,
    timer: PhaseTimer,
    device: torch.device,
) -> Rollouts:
    """Generate and score this rank's batch; with algorithm.filter_groups (DAPO's dynamic sampling),
    keep only prompts whose samples differ in the filter metric and generate further batches until
    every rank has its share of prompts, then take each rank's first ones.

    verl pools kept groups over the whole world; here each rank must end with the same number of rows
    (the update's FSDP collectives run once per micro-batch on every rank), so the decision to generate
    more is made on the smallest per-rank count, identical on every rank (one all_reduce per batch).
    """
    fg, ob, n = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer, cfg.rollout.n
    target = 0
    kept: list[tuple[PromptExample, list[Generation], list[float], list[str]]] = []
    errors = timeouts = dropped = generated = 0
    penalties: list[float] = []
    for gen_batch in range(1, 1_000_000):
        with timer("rollout"):
            prompts = [train_ds[i] for i in sampler.next_batch()]
            seed = (cfg.rollout.seed * 1_000_003 + step) * 1_000 + gen_batch - 1
            spec = SamplingSpec.for_training(cfg.rollout, cfg.data.max_response_length, seed=seed)
            gens = rollout.generate(prompts, spec)
        with timer("reward"):
            result, responses = score(cfg, reward_fn, tokenizer, prompts, gens)
        target = len(prompts)
        scores = result.scores_B.clone()
        if ob.enable:
            lengths_B = torch.tensor([len(g.token_ids) for g in gens])
            penalty_B = overlong_penalty(lengths_B, cfg.data.max_response_length, ob.len, ob.penalty_factor)
            scores = scores + penalty_B
            penalties += penalty_B.tolist()
        errors, timeouts, generated = (
            errors + result.num_errors,
            timeouts + result.num_timeouts,
            generated + len(prompts),
        )
        group_ids_B = torch.arange(len(prompts)).repeat_interleave(n)
        keep_B = torch.ones(len(gens), dtype=torch.bool)
        if fg.enable:
            metric_B = {
                "acc": (result.scores_B >= 1.0).float(),
                "score": result.scores_B,
                "seq_final_reward": scores,
            }[fg.metric]
            keep_B = groups_with_signal(metric_B, group_ids_B)
        for i, p in enumerate(prompts):
            if keep_B[i * n]:
                rows = range(i * n, (i + 1) * n)
                kept.append(
                    (
                        p,
                        [gens[r] for r in rows],
                        [float(scores[r]) for r in rows],
                        [responses[r] for r in rows],
                    )
                )
            else:
                dropped += 1
        if not fg.enable:
            break
        fewest = int(all_reduce_min({"kept": len(kept)}, device)["kept"])
        try:
            if not should_generate_more(fewest, target, gen_batch, fg.max_num_gen_batches):
                break
        except ValueError as e:
            raise RuntimeError(f"step {step}: {e}") from None
    kept = kept[:target]
    out_prompts = [k[0] for k in kept]
    out_gens = [dataclasses.replace(g, prompt_index=i) for i, k in enumerate(kept) for g in k[1]]
    rewards = RewardResult(torch.tensor([s for k in kept for s in k[2]]), errors, timeouts)
    metrics: dict[str, float] = rollout.take_metrics(device)
    if fg.enable:
        totals = all_reduce_sum(
            {"batches": gen_batch, "kept": generated - dropped, "dropped": dropped}, device
        )
        world = dist.get_world_size()
        dyn = dynamic_sampling_metrics(
            int(totals["batches"] / world), int(totals["kept"]), int(totals["dropped"])
        )
        metrics.update({f"rollout/{k}": v for k, v in dyn.items()})
    if ob.enable:
        t = all_reduce_sum(
            {"sum": sum(penalties), "over": sum(p < 0 for p in penalties), "n": len(penalties)}, device
        )
        metrics["reward/overlong_penalty_mean"] = t["sum"] / max(t["n"], 1)
        metrics["reward/overlong_frac"] = t["over"] / max(t["n"], 1)
    return Rollouts(out_prompts, out_gens, rewards, [r for k in kept for r in k[3]], metrics)


def kl_in_reward(
    cfg: Config,
    batch: PolicyBatch,
    token_rewards_BT: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's use_kl_in_reward: rewards minus coef x KL(rollout policy || reference) per token; the
    adaptive controller moves coef with the KL of the whole batch (all ranks), so every rank agrees."""
    assert batch.ref_logprobs_BT is not None
    policy_BT = batch.old_logprobs_BT if batch.old_logprobs_BT is not None else batch.engine_logprobs_BT
    rewards_BT, mean_kl = apply_kl_penalty(
        token_rewards_BT,
        policy_BT,
        batch.ref_logprobs_BT,
        batch.response_mask_BT,
        kl_ctrl.value,
        cfg.algorithm.kl_penalty,
    )
    total = all_reduce_sum({"kl": float(mean_kl) * batch.num_rows, "n": batch.num_rows}, device, group)
    coef = kl_ctrl.value
    kl_ctrl.update(total["kl"] / total["n"], int(total["n"]))
    return rewards_BT, {
        "actor/reward_kl_penalty": total["kl"] / total["n"],
        "actor/reward_kl_penalty_coeff": coef,
    }


def correct_rollout(
    cfg: Config, batch: PolicyBatch, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[PolicyBatch, dict[str, float]]:
    """verl's rollout correction: importance weights and rejection of the tokens or sequences whose
    engine logprobs stray too far from the trainer's (spmdrl/algos/correction.py)."""
    rc = cfg.algorithm.rollout_correction
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
    # Means over ranks (each rank's metric is over its own tokens).
    metrics = {
        f"rollout_corr/{k}": v / dist.get_world_size(group)
        for k, v in all_reduce_sum({k: float(v) for k, v in corr.metrics.items()}, device, group).items()
    }
    return batch.replace(response_mask_BT=corr.mask_BT, is_weights_BT=corr.is_weights_BT), metrics


def greedy_rollout(
    rollout: Rollout, prompts: list[PromptExample], cfg: Config, step: int
) -> list[Generation]:
    """One greedy completion per prompt (remax's baseline)."""
    spec = SamplingSpec(
        n=1, temperature=0.0, max_tokens=cfg.data.max_response_length, stop=list(cfg.rollout.stop), seed=step
    )
    return rollout.generate(prompts, spec)


def train_samples(
    step: int,
    tokenizer: object,
    prompts: list[PromptExample],
    gens: list[Generation],
    responses: list[str],
    rewards: RewardResult,
    cfg: Config,
) -> list[Sample]:
    return [
        Sample(
            step,
            "train",
            tokenizer.decode(prompts[g.prompt_index].prompt_ids),  # type: ignore[attr-defined]
            r,
            prompts[g.prompt_index].ground_truth,
            s,
            prompts[g.prompt_index].data_source,
        )
        for g, r, s in list(zip(gens, responses, rewards.scores_B.tolist(), strict=True))[
            : cfg.logging.samples_per_log
        ]
    ]


def validate(
    run: Run,
    rollout: Rollout,
    tokenizer: object,
    reward_fn: object,
    val_ds: PromptDataset,
    max_tokens: int,
) -> tuple[dict[str, float], list[Sample]]:
    """Greedy decoding on the whole held-out split, sharded over ranks; accuracy = reward >= 1."""
    cfg, env = run.cfg, run.env
    mine = [val_ds[i] for i in range(env.rank, len(val_ds), env.world_size)]
    gens = rollout.generate(
        mine,
        SamplingSpec.for_validation(cfg.rollout, max_tokens, seed=cfg.rollout.seed),
    )
    tool_metrics = {f"val/{k}": v for k, v in rollout.take_metrics(env.device).items()}
    result, responses = score(cfg, reward_fn, tokenizer, mine, gens)
    sums: dict[str, float] = defaultdict(float)
    for g, s in zip(gens, result.scores_B.tolist(), strict=True):
        src = mine[g.prompt_index].data_source or "unknown"
        sums["n"] += 1
        sums["reward"] += s
        sums["correct"] += float(s >= 1.0)
        sums[f"n/{src}"] += 1
        sums[f"correct/{src}"] += float(s >= 1.0)
    # Every rank must reduce the same keys: gather the set of data sources first.
    sources: list[set[str]] = [set() for _ in range(env.world_size)]
    dist.all_gather_object(sources, {k for k in sums if k.startswith("n/")})
    for k in set().union(*sources):
        sums.setdefault(k, 0.0)
        sums.setdefault("correct/" + k[2:], 0.0)
    total = all_reduce_sum(dict(sums), env.device)
    metrics = {
        "val/accuracy": total["correct"] / max(total["n"], 1),
        "val/reward_mean": total["reward"] / max(total["n"], 1),
        **tool_metrics,
    }
    for k in total:
        if k.startswith("n/"):
            metrics[f"val/accuracy/{k[2:]}"] = total["correct/" + k[2:]] / max(total[k], 1)
    samples = [
        Sample(
            0,
            "val",
            tokenizer.decode(mine[g.prompt_index].prompt_ids),
            r,
            mine[g.prompt_index].ground_truth,
            s,
            mine[g.prompt_index].data_source,
        )  # type: ignore[attr-defined]
        for g, r, s in list(zip(gens, responses, result.scores_B.tolist(), strict=True))[
            : cfg.logging.samples_per_log
        ]
    ]
    return metrics, samples


# --------------------------------------------------------------------------------------- the run
def main(cfg: Config) -> None:
    run = start_run(cfg)
    env = run.env
    t_start = time.perf_counter()
    # An engine this machine cannot run (vLLM release, forced CPU GEMM path) fails now, not after the SFT.
    check_engine_config(cfg.rollout, env.device.type)
    # Which ranks run which role (a placement that cannot fit this world fails here, before any model).
    a, n = cfg.algorithm, cfg.rollout.n
    placement = plan_placement(cfg.parallel, env.world_size, needs_critic=a.adv_estimator in NEEDS_CRITIC)
    check_tp_within_nodes(cfg.rollout.tp, *node_layout_from_env())  # an engine never spans two nodes
    log.info("placement %s", placement.describe())

    # Resume: the newest complete checkpoint of this output directory (trainer.resume=auto), a path, or
    # none. Rank 0 decides for everyone (every rank must agree on it).
    restarted = restart_count() > 0
    found = plan_resume(cfg.trainer.resume, run.output_dir, restarted=restarted) if env.is_main else None
    resume_from = Path(p) if (p := broadcast_str(str(found or ""))) else None

    # Data, rewards and batch arithmetic: every check that can fail does so before the warm-start and the
    # engine (the tokenizer is the base model's; the warm-start's export keeps it).
    base_dir = resolve_model_path_all_ranks(cfg.model.path, run.cache_dir)
    tokenizer = load_tokenizer(base_dir, cfg.model.trust_remote_code)
    # Multi-turn tools load first: the prompts describe them to the model (the chat template's tools).
    tools = load_multi_turn_tools(cfg) if cfg.rollout.multi_turn.enable else None
    schemas = tool_schemas(tools) if tools else None
    train_ds = load_prompts(run, tokenizer, cfg.data.train_files, schemas)
    val_ds = load_prompts(run, tokenizer, cfg.data.val_files, schemas) if cfg.data.val_files else None
    derived = derive(cfg, env.world_size, len(train_ds), samples_per_item=cfg.rollout.n)
    if placement.is_split:
        rl = derive_rl(cfg, derived, train_ranks=placement.role("actor").num_ranks, role="actor")
        rl_critic = derive_rl(cfg, derived, train_ranks=placement.role("critic").num_ranks, role="critic")
    else:
        rl = rl_critic = derive_rl(cfg, derived)
    check_model_fits(base_dir, rl.max_model_len, cfg.rollout.tp, cfg.model.trust_remote_code)
    # Multi-turn: the chat template must render tool turns, the parser must load (before the warm-start).
    agent = build_agent_loop(cfg, tokenizer, tools, max_model_len=rl.max_model_len)
    reward_fn = load_reward_fn(cfg.reward.fn)
    check_data_sources(cfg.reward.fn, _data_sources(train_ds, val_ds))

    # Model files; optionally an SFT stage first (in this same job), whose export RL starts from.
    model_dir = base_dir
    if cfg.warmstart.enabled:
        # A resumed run's warm-start is done: its export sits next to the checkpoints.
        done = resume_from.parent.parent / "sft" / "hf_model" if resume_from else None
        if done is not None and (done / "config.json").is_file():
            log.info("warm-start done earlier: %s", done)
            model_dir = done
        else:
            if env.is_main and restarted:  # an attempt that died before its first checkpoint: start over
                truncate_after(run.output_dir / "sft" / "metrics.jsonl", -1)
            model_dir = _train_sft(run, warmstart_config(cfg))

    # verl always recomputes them; here only when the update's first forward is not the old policy, or
    # when the rollout correction needs them before the update.
    recompute_old = a.ppo_epochs > 1 or rl.mini_batches_per_step > 1 or a.rollout_correction.enabled
    # Offloaded parameters take their optimizer state with them; on a CPU trainer there is nowhere to move it.
    offload_optim = cfg.model.offload_optimizer and not cfg.model.offload_params and env.device.type == "cuda"
    run.log_derived(
        derived,
        **rl.as_dict(),
        placement=placement.describe(),
        critic_per_rank_mini_batch_seqs=rl_critic.per_rank_mini_batch_seqs,
        recompute_old_logprobs=recompute_old,
        offload_optimizer_between_updates=offload_optim,
        train_prompts=len(train_ds),
        train_filtered_overlong=train_ds.num_filtered,
        val_prompts=len(val_ds) if val_ds else 0,
    )
    sampler = DistributedSampler(
        len(train_ds),
        rank=env.rank,
        world_size=env.world_size,
        batch_size_per_rank=derived.per_rank_batch_size,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )

    # Models on their meshes (colocated: the same ranks), then the engine on every rank.
    meshes = placement.build_meshes(env.device.type)
    is_actor, is_critic = meshes.holds("actor"), a.adv_estimator in NEEDS_CRITIC and meshes.holds("critic")
    actor_group, critic_group = meshes.group("actor"), meshes.group("critic")
    actor, ref = build_models(cfg, env.device, meshes, model_dir)
    critic = build_critic(cfg, env.device, meshes, model_dir, run.cache_dir) if is_critic else None
    optimizer = build_optimizer(actor, cfg.optim) if is_actor else None
    scheduler = build_lr_scheduler(optimizer, cfg.optim, derived.total_steps) if optimizer else None
    fanout = (
        Fanout(meshes.fanout_group, placement.fanout_ranks()[0], receiving=not is_actor)
        if meshes.fanout_group is not None
        else None
    )
    engine = build_engine(model_dir, cfg.rollout, max_model_len=rl.max_model_len, device_type=env.device.type)
    rollout = Rollout(engine, agent)
    metrics_path, samples_path = run.output_dir / "metrics.jsonl", run.output_dir / "samples.jsonl"
    kl_ctrl = build_kl_controller(
        a.kl_ctrl.type, a.kl_ctrl.kl_coef, target_kl=a.kl_ctrl.target_kl, horizon=a.kl_ctrl.horizon
    )

    # The state a checkpoint holds: each trained role (model, optimizer, schedule) on its own ranks, and
    # the loop's position (step, sampler, KL coefficient); RNG states are saved per rank.
    roles = [
        RoleState(
            "actor",
            is_actor,
            actor,
            optimizer,
            scheduler,
            actor_group,
            _hf_writer(actor, tokenizer),
            placement.role("actor").ranks,
        ),
    ]
    if a.adv_estimator in NEEDS_CRITIC:
        roles.append(
            RoleState(
                "critic",
                is_critic,
                *((critic.model, critic.optimizer, critic.scheduler) if critic else (None, None, None)),
                critic_group,
                _hf_writer(critic.model, tokenizer) if critic else None,
                placement.role("critic").ranks,
            )
        )
    start_step = 0
    if resume_from is not None:
        t_load = time.perf_counter()
        state = load_checkpoint(resume_from, roles)
        log.info("loaded %s in %.2f s", resume_from, time.perf_counter() - t_load)
        start_step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        kl_ctrl.value = float(state["kl_coef"])
        # The engine was built from the starting weights: load the checkpoint's, with the usual check.
        sync_weights(
            actor,
            engine,
            bucket_mb=cfg.rollout.weight_sync_bucket_mb,
            fanout=fanout,
            device=env.device,
            check=SyncCheck(0, cfg.rollout.weight_sync_check_tol) if cfg.rollout.weight_sync_check else None,
        )
        if env.is_main:  # the steps after the checkpoint are logged again
            dropped = truncate_after(metrics_path, start_step) + truncate_after(samples_path, start_step)
            log.info(
                "resumed from %s: step %d of %d (%d later log rows dropped)",
                resume_from,
                start_step,
                derived.total_steps,
                dropped,
            )
    elif restarted and env.is_main:
        truncate_after(metrics_path, -1)
        truncate_after(samples_path, -1)
    if start_step >= derived.total_steps:
        log.info("the checkpoint is at the last step (%d): nothing left to train", start_step)
    logger = run.metric_logger(derived.total_steps, resume_step=start_step)
    checkpointer = Checkpointer(
        checkpoint_root(run.output_dir),
        roles,
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_save,
    )
    max_tokens = cfg.data.max_response_length
    pad_id = tokenizer.pad_token_id

    def run_validation(step: int) -> dict[str, float]:
        metrics, samples = validate(run, rollout, tokenizer, reward_fn, val_ds, max_tokens)  # type: ignore[arg-type]
        if env.is_main:
            write_samples(samples_path, [dataclasses.replace(s, step=step) for s in samples])
        return metrics

    if val_ds is not None and cfg.trainer.val_every > 0 and start_step == 0:
        logger.log(0, run_validation(0))

    for step in range(start_step + 1, derived.total_steps + 1):
        timer = PhaseTimer()

        # 1-2. Rollout and reward on every rank: this rank's prompts, rollout.n samples each, grouped by
        #      prompt (with DAPO's dynamic sampling, more batches until every rank has enough groups
        #      with signal).
        ro = rollout_and_score(cfg, rollout, sampler, train_ds, tokenizer, reward_fn, step, timer, env.device)
        check_reward_errors(cfg, ro.rewards, step, env.device)
        prompts, gens, rewards, responses = ro.prompts, ro.gens, ro.rewards, ro.responses
        baseline_B = None
        if a.adv_estimator in NEEDS_BASELINE:  # remax: each prompt's greedy answer is its baseline
            with timer("rollout"):
                greedy = greedy_rollout(rollout, prompts, cfg, step)
            with timer("reward"):
                baseline_B = score(cfg, reward_fn, tokenizer, prompts, greedy)[0].scores_B.repeat_interleave(
                    n
                )
        engine.sleep(keep_weights=False)  # CUDA: the next engine call is the sync; CPU: a no-op
        local = build_policy_batch([p.prompt_ids for p in prompts], gens, pad_id=pad_id).to(env.device)
        local = local.replace(
            token_rewards_BT=token_level_rewards(rewards.scores_B.to(env.device), local.response_mask_BT)
        )

        # Split placement: the rows go to the actor's ranks and to the critic's (tensor point-to-point).
        rows = plan_rows(cfg, placement, rl, rl_critic, local, env.device)
        with timer.maybe("exchange", rows.moves):
            batch = rows.to_actor(local)
            critic_batch = rows.to_critic(local) if critic is not None or placement.is_split else None
        sampled_mask_BT = batch.response_mask_BT if batch is not None else None  # before any rejection

        # 3. Old (a separate pass when the update takes several optimizer steps or corrects the rollout)
        #    and reference logprobs on the actor's ranks; values on the critic's (at once, when split).
        temp, pack = cfg.rollout.temperature, cfg.trainer.pack_sequences
        if batch is not None:
            with timer("old_ref"):
                if recompute_old:
                    parts = micro_rows(cfg, rl, batch, actor_group)
                    batch = batch.replace(old_logprobs_BT=logprobs_of(actor, batch, parts, temp, pack))
                if ref is not None:
                    parts = micro_rows(cfg, rl, batch, actor_group)
                    batch = batch.replace(ref_logprobs_BT=logprobs_of(ref, batch, parts, temp, pack))
        if critic is not None:
            assert critic_batch is not None
            with timer("values"):
                parts = micro_rows(cfg, rl_critic, critic_batch, critic_group)
                critic_batch = critic_batch.replace(
                    values_BT=values_of(critic.model, critic_batch, parts, pack)
                )
        if a.adv_estimator in NEEDS_CRITIC:
            with timer.maybe("exchange", rows.moves):
                batch = rows.values_to_actor(critic_batch, batch)

        # 4. Advantages on the actor's ranks (algorithm.adv_estimator; colocated, a rank holds whole groups,
        #    so no communication), with the KL to the reference folded into the reward if asked, and the
        #    rollout correction.
        extra: dict[str, float] = {}
        if batch is not None:
            assert batch.token_rewards_BT is not None
            token_rewards_BT = batch.token_rewards_BT
            if a.use_kl_in_reward:
                token_rewards_BT, extra = kl_in_reward(
                    cfg, batch, token_rewards_BT, kl_ctrl, env.device, actor_group
                )
            estimate = advantage_estimator(cfg, batch.num_rows // n, baseline_B, batch.values_BT)
            advantages_BT, returns_BT = estimate(token_rewards_BT, batch.response_mask_BT)
            batch = batch.replace(advantages_BT=advantages_BT, returns_BT=returns_BT)
            if a.rollout_correction.enabled:
                batch, corr_metrics = correct_rollout(cfg, batch, env.device, actor_group)
                extra.update(corr_metrics)
        with timer.maybe("exchange", rows.moves):
            if a.adv_estimator in NEEDS_CRITIC:
                critic_batch = rows.returns_to_critic(batch, critic_batch)
            # parallel.balance_tokens, colocated: rows move only now, once the group advantages are known.
            batch, sampled_mask_BT = rows.balance_colocated(batch, sampled_mask_BT)
        if critic is not None and not placement.is_split:
            critic_batch = batch

        # 5. Update the critic and the actor: one after the other when colocated, at the same time on
        #    their own ranks when split.
        critic_metrics: dict[str, float] = {}
        update: UpdateResult | None = None
        with timer("update"):
            if critic is not None:
                assert critic_batch is not None
                with timer("critic_update"), optimizer_state_on(critic.optimizer, env.device, offload_optim):
                    critic_metrics = update_critic(cfg, rl_critic, critic, critic_batch, critic_group)
            if batch is not None:
                assert optimizer is not None and scheduler is not None
                with timer("actor_update"):
                    if a.adv_estimator in NEEDS_CRITIC and step <= cfg.critic.warmup_steps:
                        # critic.warmup_steps: the actor waits for values that mean something (verl's
                        # critic_warmup); its logprobs are still computed, for the trainer-vs-engine metrics.
                        old_BT = (
                            batch.old_logprobs_BT
                            if batch.old_logprobs_BT is not None
                            else logprobs_of(
                                actor, batch, micro_rows(cfg, rl, batch, actor_group), temp, pack
                            )
                        )
                        update = UpdateResult({}, old_BT)
                    else:
                        with optimizer_state_on(optimizer, env.device, offload_optim):
                            update = update_policy(cfg, rl, actor, optimizer, batch, actor_group)
                        scheduler.step()  # once per RL step (optim.warmup_steps counts RL steps)

        # 6. Sync the new weights into every rank's engine; the check proves each engine now serves exactly
        #    them (split: the critic's ranks receive them from the first actor rank).
        with timer("weight_sync"):
            check = (
                SyncCheck(step, cfg.rollout.weight_sync_check_tol) if cfg.rollout.weight_sync_check else None
            )
            sync = sync_weights(
                actor,
                engine,
                bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                check=check,
                fanout=fanout,
                device=env.device,
            )
        timer.add("weight_sync_check", sync.check_seconds)

        # 7. Log: metrics reduced over ranks (each role's over its own), samples, validation, curves.
        actor_part = None
        if batch is not None:
            assert update is not None and sampled_mask_BT is not None
            actor_part = (batch, sampled_mask_BT, update.old_logprobs_BT)
        if placement.is_split:  # the first critic rank tells rank 0, which logs
            critic_metrics = broadcast_object(critic_metrics, src=placement.role("critic").first_rank)
        metrics = {
            **step_metrics(cfg, ro, timer, env.device, actor_part, actor_group),
            **(update.metrics if update is not None else {}),
            **critic_metrics,
            **extra,
            **rows.metrics,
        }
        if scheduler is not None:
            metrics["actor/lr"] = scheduler.get_last_lr()[0]
        if env.is_main and cfg.logging.samples_every > 0 and step % cfg.logging.samples_every == 0:
            write_samples(
                samples_path, train_samples(step, tokenizer, prompts, gens, responses, rewards, cfg)
            )
        is_last = step == derived.total_steps
        if (
            val_ds is not None
            and cfg.trainer.val_every > 0
            and (step % cfg.trainer.val_every == 0 or is_last)
        ):
            metrics.update(run_validation(step))
        metrics["timing/step_s"] = timer.elapsed()
        logger.log(step, metrics)
        if env.is_main and "val/accuracy" in metrics:
            plot_curves(metrics_path, run.output_dir / "curves.png", CURVE_KEYS, title=cfg.name)
        # Logged first, saved second: a kill between them loses no row (the resumed run logs it again).
        if is_last or (cfg.trainer.save_every > 0 and step % cfg.trainer.save_every == 0):
            saved = checkpointer.save(
                step,
                {"sampler": sampler.state_dict(), "kl_coef": kl_ctrl.value},
                meta={"placement": placement.describe(), "total_steps": derived.total_steps},
            )
            if saved is not None:
                log.info("checkpoint %s: %.1f MB in %.2f s", saved.path, saved.bytes / 1e6, saved.seconds)

    saved = checkpointer.finish()  # an asynchronous save still in flight
    if saved is not None:
        log.info("checkpoint %s: %.1f MB in %.2f s", saved.path, saved.bytes / 1e6, saved.seconds)
    if cfg.trainer.save_hf:
        from spmdrl.checkpoint.export import export_hf

        if is_actor:
            export_hf(actor, tokenizer, run.output_dir / "hf_model", group=actor_group)
        if critic is not None:
            export_hf(critic.model, tokenizer, run.output_dir / "critic_hf_model", group=critic_group)
    engine.close()
    logger.close()
    if env.is_main and metrics_path.exists():
        plot_curves(metrics_path, run.output_dir / "curves.png", CURVE_KEYS, title=cfg.name)
    dist.barrier()
    log.info(
        "done: %d steps in %.0f s, outputs in %s",
        derived.total_steps,
        time.perf_counter() - t_start,
        run.output_dir,
    )


def check_reward_errors(cfg: Config, rewards: RewardResult, step: int, device: torch.device) -> None:
    """Stop the run, on every rank at once, when more than reward.max_error_frac of the step's samples
    failed to score: a reward function that always raises would otherwise train on zeros to the end."""
    t = all_reduce_sum(
        {
            "bad": rewards.num_errors + rewards.num_timeouts,
            "timeouts": rewards.num_timeouts,
            "n": len(rewards.scores_B),
        },
        device,
    )
    frac = t["bad"] / max(t["n"], 1)
    if frac > cfg.reward.max_error_frac:
        raise RuntimeError(
            f"step {step}: {int(t['bad'])} of {int(t['n'])} samples ({frac:.0%}) got no score from reward.fn="
            f"{cfg.reward.fn} ({int(t['timeouts'])} timed out, the rest raised or returned something that is not "
            f"a finite number), above reward.max_error_frac={cfg.reward.max_error_frac}. The first error of each "
            "rank is logged above with its traceback; fix the function (or raise reward.max_error_frac)"
        )


def _data_sources(*datasets: PromptDataset | None) -> set[str]:
    return {ds[i].data_source for ds in datasets if ds is not None for i in range(len(ds))}


def check_model_fits(model_dir: Path, max_model_len: int, tp: int, trust_remote_code: bool) -> None:
    """Prompt + response must fit the model's positions, and rollout.tp must split its attention heads:
    vLLM would refuse either only once the engine is built, after the warm-start."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_model_len > limit:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length (or rollout.max_model_len) = {max_model_len} "
            f"exceeds the model's max_position_embeddings={limit} ({model_dir}); shorten them"
        )
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads and (heads % tp or (kv and kv % tp and tp % kv)):
        fits = [t for t in range(1, heads + 1) if heads % t == 0 and (not kv or kv % t == 0 or t % kv == 0)]
        raise ConfigError(
            f"rollout.tp={tp} does not split the model's {heads} attention heads ({kv} key/value heads; "
            f"{model_dir}); use one of {fits}"
        )


def _hf_writer(model: torch.nn.Module, tokenizer: object) -> Callable[[Path], None]:
    return lambda d: write_hf_metadata(model, tokenizer, d)


def _train_sft(run: Run, sft_cfg: Config) -> Path:
    from spmdrl.recipes.sft import train_sft

    try:
        return train_sft(run, sft_cfg, stage="sft")
    except ConfigError as e:
        raise ConfigError(
            f"in the SFT warm-start (its trainer.* batch keys come from warmstart.*): {e}"
        ) from None


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_grpo.py recipe=grpo_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
