"""GRPO as one SPMD program. Read it top to bottom: it is the step in docs/architecture.md.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=grpo_tiny

Every rank, every step:
  1. rollout    its shard of the prompts -> rollout.n samples each, from the in-process vLLM engine
  2. reward     rule / user reward functions on its own samples (sandboxed, with a timeout)
  3. advantage  group-normalized rewards; a rank holds whole groups, so no communication
  4. old, ref   the trainer's and the reference model's logprobs of the sampled tokens
  5. update     PPO-clipped surrogate + KL loss, mini-batches x micro-batches, global-token normalized
  6. sync       the actor's FSDP2 shards -> full tensors per bucket -> the engine, in place
  7. log        metrics (reduced over ranks), samples, validation, curves

Deliberately simple: one reference model colocated with the actor, no critic, no sequence packing,
no resume yet (the checkpoint hook point is marked).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from spmdrl.algos.advantages import grpo_advantages
from spmdrl.algos.batch import PolicyBatch
from spmdrl.algos.kl import kl_penalty
from spmdrl.algos.losses import (
    aggregate,
    aggregation_count,
    ppo_policy_loss,
    truncated_is_weights,
)
from spmdrl.config import Config, ConfigError, OptimConfig, RLDerived, derive, derive_rl
from spmdrl.data.prompts import PromptDataset, PromptExample
from spmdrl.data.sampler import DistributedSampler
from spmdrl.data.tiny_task import resolve_data_files
from spmdrl.dist.placement import Placement
from spmdrl.dist.reduce import all_reduce_max, all_reduce_sum
from spmdrl.logging.plot import plot_curves
from spmdrl.logging.samples import Sample, write_samples
from spmdrl.models.build import build_fsdp_model, model_spec
from spmdrl.models.forward import policy_logprobs
from spmdrl.models.load import load_tokenizer, resolve_model_path_all_ranks
from spmdrl.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from spmdrl.rewards.registry import RewardInput, load_reward_fn
from spmdrl.rewards.sandbox import RewardResult, score_batch
from spmdrl.rollout.engine import (
    Generation,
    RolloutEngine,
    SamplingSpec,
    build_engine,
    check_engine_config,
)
from spmdrl.rollout.mismatch import logprob_mismatch, pack_generations
from spmdrl.rollout.weight_sync import SyncCheck, sync_weights
from spmdrl.runtime import Run, start_run

log = logging.getLogger("spmdrl")

CURVE_KEYS = ["rollout/reward_mean", "val/accuracy"]


# ----------------------------------------------------------------------------------------- set-up
def warmstart_config(cfg: Config) -> Config:
    """The SFT stage's config: the RL config with the warm-start's optimizer and batch settings."""
    ws = cfg.warmstart
    return dataclasses.replace(
        cfg,
        optim=OptimConfig(lr=ws.lr, schedule="cosine", warmup_steps=ws.warmup_steps, min_lr_ratio=0.1),
        trainer=dataclasses.replace(
            cfg.trainer,
            total_steps=ws.total_steps,
            global_batch_size=ws.global_batch_size,
            micro_batch_size=ws.micro_batch_size,
            val_every=0,
            save_hf=True,
        ),
    )


def load_prompts(run: Run, tokenizer: object, files: list[str]) -> PromptDataset:
    d = run.cfg.data
    return PromptDataset(
        resolve_data_files(files, run.cache_dir, d.tiny),
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        overlong=d.overlong,
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
            extra_info=prompts[g.prompt_index].extra_info,
        )
        for r, g in zip(responses, gens, strict=True)
    ]
    result = score_batch(
        reward_fn, inputs, timeout_s=cfg.reward.timeout_s, error_score=cfg.reward.error_score
    )  # type: ignore[arg-type]
    return result, responses


@torch.no_grad()
def fill_logprobs(
    model: torch.nn.Module, batch: PolicyBatch, out_BT: torch.Tensor, micro: int, temperature: float
) -> None:
    """A no-grad pass over the rank's batch writing each token's logprob into ``out_BT``."""
    for start in range(0, batch.num_rows, micro):
        mb = batch.rows(start, start + micro)
        lp_BT, _ = policy_logprobs(model, mb.input_ids_BT, mb.attention_mask_BT, temperature=temperature)
        out_BT[start : start + micro, : lp_BT.shape[1]] = lp_BT


@dataclasses.dataclass
class MicroBatchLoss:
    """One micro-batch's loss, the only tensor that holds its autograd graph, and detached by-products."""

    loss: torch.Tensor  # scalar to backpropagate
    logprobs_BT: torch.Tensor  # detached: the current policy's logprobs of the tokens
    stats: dict[str, torch.Tensor]  # detached scalars: pg_loss, entropy, clip_frac, approx_kl (+ kl)


def micro_batch_loss(
    cfg: Config,
    actor: torch.nn.Module,
    mb: PolicyBatch,
    old_BT: torch.Tensor | None,
    dp_size: int,
    counts: dict[str, float],
) -> MicroBatchLoss:
    """Clipped surrogate (+ KL loss) (- entropy bonus) of one micro-batch, normalized by ``counts``.

    ``old_BT`` None is the on-policy single update: the policy before the step *is* the current one.
    The entropy gets a gradient only when it enters the loss (algorithm.entropy_coeff > 0); as a mere
    metric it is computed without one, since its graph would keep a B x T x V float32 softmax alive.
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
    )
    assert ent_BT is not None
    mask_BT = mb.response_mask_BT
    if old_BT is None:
        old_BT = lp_BT.detach()
    is_w = truncated_is_weights(old_BT, mb.engine_logprobs_BT, mask_BT, a.tis_cap) if a.tis_cap > 0 else None
    pg = ppo_policy_loss(
        lp_BT,
        old_BT,
        mb.advantages_B,
        mask_BT,
        clip_low=a.clip_ratio_low,
        clip_high=a.clip_ratio_high,
        agg=a.loss_agg_mode,
        dp_size=dp_size,
        is_weights_BT=is_w,
        **counts,
    )
    loss = pg.loss
    stats = {"pg_loss": pg.loss.detach(), "clip_frac": pg.clip_frac, "approx_kl": pg.approx_kl}
    if a.use_kl_loss:
        kl_BT = kl_penalty(lp_BT, mb.ref_logprobs_BT, a.kl_loss_type)
        kl_loss = aggregate(kl_BT, mask_BT, a.loss_agg_mode, dp_size=dp_size, **counts)
        loss = loss + a.kl_loss_coef * kl_loss
        stats["kl"] = kl_loss.detach()
    ent_loss = aggregate(ent_BT, mask_BT, a.loss_agg_mode, dp_size=dp_size, **counts)
    if entropy_in_loss:
        loss = loss - a.entropy_coeff * ent_loss
    stats["entropy"] = ent_loss.detach()
    return MicroBatchLoss(loss=loss, logprobs_BT=lp_BT.detach(), stats=stats)


def update_policy(
    cfg: Config,
    rl: RLDerived,
    dp_size: int,
    actor: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PolicyBatch,
    recompute_old: bool,
    pre_update_BT: torch.Tensor,
) -> dict[str, float]:
    """PPO epochs x mini-batches; each mini-batch is one optimizer step over its micro-batches.

    Losses are normalized by the count (tokens or sequences, per algorithm.loss_agg_mode) of the
    whole mini-batch on all ranks, counted once with one all_reduce: see spmdrl/algos/losses.py.
    """
    a, t = cfg.algorithm, cfg.trainer
    device = batch.input_ids_BT.device
    sums: dict[str, float] = defaultdict(float)
    grad_norms = []
    for epoch in range(a.ppo_epochs):
        for m in range(rl.mini_batches_per_step):
            lo = m * rl.per_rank_mini_batch_seqs
            micro_batches = [
                batch.rows(s, s + t.micro_batch_size)
                for s in range(lo, lo + rl.per_rank_mini_batch_seqs, t.micro_batch_size)
            ]
            local = sum(aggregation_count(mb.response_mask_BT, a.loss_agg_mode) for mb in micro_batches)
            global_count = all_reduce_sum({"n": local}, device)["n"]
            counts = {"global_tokens" if a.loss_agg_mode == "token-mean" else "global_seqs": global_count}
            for i, mb in enumerate(micro_batches):
                out = micro_batch_loss(
                    cfg, actor, mb, mb.old_logprobs_BT if recompute_old else None, dp_size, counts
                )
                if not recompute_old:
                    row0 = lo + i * t.micro_batch_size
                    pre_update_BT[row0 : row0 + mb.num_rows, : out.logprobs_BT.shape[1]] = out.logprobs_BT
                out.loss.backward()
                # Per-mini-batch sums of the normalized parts: averaged over ranks below they are the
                # mini-batch means; clip_frac / approx_kl are micro-batch means, averaged.
                st = out.stats
                if "kl" in st:
                    sums["kl"] += float(st["kl"])
                sums["pg_loss"] += float(st["pg_loss"])
                sums["entropy"] += float(st["entropy"])
                sums["clip_frac"] += float(st["clip_frac"]) / len(micro_batches)
                sums["approx_kl"] += float(st["approx_kl"]) / len(micro_batches)
                # The last reference to this micro-batch's graph: dropped before the next forward, not
                # when `out` is reassigned after it, so no part of it can add to the next one's peak.
                del out, st
            grad_norms.append(clip_grad_norm(actor, cfg.optim.grad_clip))
            if not math.isfinite(grad_norms[-1]):
                raise FloatingPointError(
                    f"non-finite gradient norm in PPO epoch {epoch} mini-batch {m}; try a lower optim.lr "
                    f"(now {cfg.optim.lr}) or check the rewards"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    updates = a.ppo_epochs * rl.mini_batches_per_step
    reduced = all_reduce_sum(dict(sums), device)
    out = {f"train/{k}": v / dp_size / updates for k, v in reduced.items()}
    out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def validate(
    run: Run,
    engine: RolloutEngine,
    tokenizer: object,
    reward_fn: object,
    val_ds: PromptDataset,
    max_tokens: int,
) -> tuple[dict[str, float], list[Sample]]:
    """Greedy decoding on the whole held-out split, sharded over ranks; accuracy = reward >= 1."""
    cfg, env = run.cfg, run.env
    mine = [val_ds[i] for i in range(env.rank, len(val_ds), env.world_size)]
    gens = engine.generate(
        [p.prompt_ids for p in mine],
        SamplingSpec.for_validation(cfg.rollout, max_tokens, seed=cfg.rollout.seed),
    )
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

    # Model files; optionally an SFT stage first (in this same job), whose export RL starts from.
    model_dir = resolve_model_path_all_ranks(cfg.model.path, run.cache_dir)
    if cfg.warmstart.enabled:
        model_dir = _train_sft(run, warmstart_config(cfg))
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)

    # Data, rewards and batch arithmetic: every check that can fail does so before the engine is built.
    train_ds = load_prompts(run, tokenizer, cfg.data.train_files)
    val_ds = load_prompts(run, tokenizer, cfg.data.val_files) if cfg.data.val_files else None
    derived = derive(cfg, env.world_size, len(train_ds), samples_per_item=cfg.rollout.n)
    rl = derive_rl(cfg, derived)
    reward_fn = load_reward_fn(cfg.reward.fn)
    recompute_old = cfg.algorithm.ppo_epochs > 1 or rl.mini_batches_per_step > 1
    run.log_derived(
        derived,
        **rl.as_dict(),
        recompute_old_logprobs=recompute_old,
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
    meshes = Placement.colocated(env.world_size, cfg.parallel.dp_replicate).build_meshes(env.device.type)
    actor = build_fsdp_model(
        model_spec(cfg.model, model_dir, env.device, train=True), meshes.fsdp("actor"), env.device
    )
    ref = None
    if cfg.algorithm.use_kl_loss:
        ref = build_fsdp_model(
            model_spec(cfg.model, model_dir, env.device, train=False), meshes.fsdp("ref"), env.device
        )
    optimizer = build_optimizer(actor, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, derived.total_steps)
    engine = build_engine(model_dir, cfg.rollout, max_model_len=rl.max_model_len, device_type=env.device.type)
    logger = run.metric_logger(derived.total_steps)
    metrics_path, samples_path = run.output_dir / "metrics.jsonl", run.output_dir / "samples.jsonl"
    max_tokens = cfg.data.max_response_length
    pad_id = tokenizer.pad_token_id

    def run_validation(step: int) -> dict[str, float]:
        metrics, samples = validate(run, engine, tokenizer, reward_fn, val_ds, max_tokens)  # type: ignore[arg-type]
        if env.is_main:
            write_samples(samples_path, [dataclasses.replace(s, step=step) for s in samples])
        return metrics

    if val_ds is not None and cfg.trainer.val_every > 0:
        logger.log(0, run_validation(0))

    for step in range(1, derived.total_steps + 1):
        t_step = time.perf_counter()
        timing: dict[str, float] = {}

        # 1. Rollout: this rank's prompts, rollout.n samples each, grouped by prompt.
        t0 = time.perf_counter()
        prompts = [train_ds[i] for i in sampler.next_batch()]
        spec = SamplingSpec.for_training(cfg.rollout, max_tokens, seed=cfg.rollout.seed * 1_000_003 + step)
        gens = engine.generate([p.prompt_ids for p in prompts], spec)
        engine.sleep(keep_weights=False)  # CUDA: free its memory; the next use, sync (6), reloads it all
        timing["rollout_s"] = time.perf_counter() - t0

        # 2. Reward, on this rank's own samples.
        t0 = time.perf_counter()
        rewards, responses = score(cfg, reward_fn, tokenizer, prompts, gens)
        timing["reward_s"] = time.perf_counter() - t0

        # 3. Advantages: the rank holds whole groups, so group statistics need no communication.
        advantages_B = grpo_advantages(
            rewards.scores_B, cfg.rollout.n, norm_by_std=cfg.algorithm.norm_adv_by_std
        )
        packed = pack_generations([p.prompt_ids for p in prompts], gens, pad_id)
        zeros_BT = torch.zeros_like(packed.engine_logprobs_BT)
        batch = PolicyBatch(
            input_ids_BT=packed.input_ids_BT,
            attention_mask_BT=packed.attention_mask_BT,
            response_mask_BT=packed.response_mask_BT,
            engine_logprobs_BT=packed.engine_logprobs_BT,
            advantages_B=advantages_B,
            old_logprobs_BT=zeros_BT,
            ref_logprobs_BT=zeros_BT.clone(),
        ).to(env.device)

        # 4. Old and reference logprobs of the sampled tokens.
        t0 = time.perf_counter()
        micro, temp = cfg.trainer.micro_batch_size, cfg.rollout.temperature
        if recompute_old:
            fill_logprobs(actor, batch, batch.old_logprobs_BT, micro, temp)
        if ref is not None:
            fill_logprobs(ref, batch, batch.ref_logprobs_BT, micro, temp)
        timing["old_ref_s"] = time.perf_counter() - t0

        # 5. Update the actor.
        t0 = time.perf_counter()
        pre_update_BT = batch.old_logprobs_BT if recompute_old else torch.zeros_like(batch.old_logprobs_BT)
        train_metrics = update_policy(
            cfg, rl, derived.dp_size, actor, optimizer, batch, recompute_old, pre_update_BT
        )
        scheduler.step()
        timing["train_s"] = time.perf_counter() - t0

        # 6. Sync the new weights into the engine (bucketed all-gathers, loaded in place).
        # The check proves the engine's kernels now return exactly these weights, else stops the run.
        check = (
            SyncCheck(seed=step, tol=cfg.rollout.weight_sync_check_tol)
            if cfg.rollout.weight_sync_check
            else None
        )
        sync = sync_weights(actor, engine, bucket_mb=cfg.rollout.weight_sync_bucket_mb, check=check)
        timing["weight_sync_s"] = sync.seconds
        timing["weight_sync_check_s"] = sync.check_seconds

        # 7. Metrics, reduced over all ranks.
        mismatch = logprob_mismatch(
            pre_update_BT, batch.engine_logprobs_BT, batch.response_mask_BT, group=dist.group.WORLD
        )
        resp_lens = [len(g.token_ids) for g in gens]
        sums = all_reduce_sum(
            {
                "reward": float(rewards.scores_B.sum()),
                "reward_sq": float((rewards.scores_B**2).sum()),
                "n": len(gens),
                "tokens": sum(resp_lens),
                "truncated": sum(g.finish_reason == "length" for g in gens),
                "errors": rewards.num_errors,
                "timeouts": rewards.num_timeouts,
                "train_tokens": float(batch.attention_mask_BT.sum()) * cfg.algorithm.ppo_epochs,
                "solved_groups": float(
                    (rewards.scores_B.view(-1, cfg.rollout.n).min(dim=1).values >= 1.0).sum()
                ),
            },
            env.device,
        )
        slowest = all_reduce_max(timing, env.device)  # a step is as slow as its slowest rank
        n = sums["n"]
        metrics = {
            "rollout/reward_mean": sums["reward"] / n,
            "rollout/reward_std": math.sqrt(max(sums["reward_sq"] / n - (sums["reward"] / n) ** 2, 0.0)),
            "rollout/response_len_mean": sums["tokens"] / n,
            "rollout/clip_frac": sums["truncated"] / n,
            "rollout/solved_group_frac": sums["solved_groups"] / (n / cfg.rollout.n),
            # Every sample that did not get a real score: raised, bad value, or past the timeout.
            "reward/errors": sums["errors"] + sums["timeouts"],
            "reward/timeouts": sums["timeouts"],
            **train_metrics,
            "train/lr": scheduler.get_last_lr()[0],
            "mismatch/logprob_abs_diff_mean": mismatch["logprob_abs_diff_mean"],
            "mismatch/logprob_abs_diff_max": mismatch["logprob_abs_diff_max"],
            "mismatch/kl_k3": mismatch["kl_k3"],
            "perf/rollout_tokens_per_s": sums["tokens"] / max(slowest["rollout_s"], 1e-9),
            "perf/train_tokens_per_s": sums["train_tokens"] / max(slowest["train_s"], 1e-9),
            **{f"timing/{k}": v for k, v in slowest.items()},
        }
        if not math.isfinite(metrics["train/pg_loss"]):
            raise FloatingPointError(
                f"non-finite policy loss at step {step}; try a lower optim.lr (now {cfg.optim.lr})"
            )
        if env.is_main and cfg.logging.samples_every > 0 and step % cfg.logging.samples_every == 0:
            write_samples(
                samples_path,
                [
                    Sample(
                        step,
                        "train",
                        tokenizer.decode(prompts[g.prompt_index].prompt_ids),
                        r,
                        prompts[g.prompt_index].ground_truth,
                        s,
                        prompts[g.prompt_index].data_source,
                    )
                    for g, r, s in list(zip(gens, responses, rewards.scores_B.tolist(), strict=True))[
                        : cfg.logging.samples_per_log
                    ]
                ],
            )
        if (
            val_ds is not None
            and cfg.trainer.val_every > 0
            and (step % cfg.trainer.val_every == 0 or step == derived.total_steps)
        ):
            metrics.update(run_validation(step))
        metrics["timing/step_s"] = time.perf_counter() - t_step
        logger.log(step, metrics)
        if env.is_main and "val/accuracy" in metrics:
            plot_curves(metrics_path, run.output_dir / "curves.png", CURVE_KEYS, title=cfg.name)
        # Checkpoint hook point: actor, optimizer, scheduler, sampler and step are the state to save.

    if cfg.trainer.save_hf:
        from spmdrl.checkpoint.export import export_hf

        export_hf(actor, tokenizer, run.output_dir / "hf_model")
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
