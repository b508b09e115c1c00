"""Supervised fine-tuning, as one SPMD program. Read it top to bottom.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=sft_tiny

The step: each rank takes its shard of the global batch, splits it into micro-batches, and
accumulates gradients of a masked cross-entropy on response tokens only. The loss is normalized by
the number of valid tokens in the *global* batch (counted once per step with one all_reduce), so
the result does not depend on how the batch is split over ranks and micro-batches. Then grad-norm
clipping, an AdamW step and the LR schedule; periodically a validation loss with a few greedy samples
(samples.jsonl, curves.png); checkpoints every trainer.save_every steps and after the last, from which a
run resumes exactly (the RL recipes' format and rules, docs/checkpointing.md); at the end an HF export.

Deliberately simple: no sequence packing, right-padding to the longest sequence of each micro-batch.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spmdrl.algos.losses import masked_cross_entropy
from spmdrl.checkpoint.checkpointer import (
    Checkpointer,
    RoleState,
    checkpoint_root,
    load_checkpoint,
    log_saved,
    plan_resume_all_ranks,
)
from spmdrl.checkpoint.export import export_hf, write_hf_metadata
from spmdrl.config import Config, derive
from spmdrl.data.sft import SFTBatch, SFTDataset, collate_sft
from spmdrl.data.tiny_task import TinyTaskConfig, resolve_data_files
from spmdrl.data.tools_task import ToolsTaskConfig
from spmdrl.distributed.placement import Placement
from spmdrl.distributed.reduce import all_reduce_sum, all_reduce_sum_tensors
from spmdrl.logging.metrics import rewind_logs
from spmdrl.logging.plot import plot_curves
from spmdrl.logging.profiler import check_profile_steps, profile_step
from spmdrl.logging.samples import Sample, write_samples
from spmdrl.models.build import build_fsdp_model, model_spec
from spmdrl.models.generate import greedy_completions
from spmdrl.models.grad_sync import defers_grad_sync, describe_grad_sync, gradient_sync
from spmdrl.models.load import load_tokenizer, resolve_model_path_all_ranks
from spmdrl.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from spmdrl.rollout.rollout import load_multi_turn_tools
from spmdrl.runtime import Run, restart_count, start_run
from spmdrl.tools import tool_schemas

log = logging.getLogger("spmdrl")

CURVE_KEYS = ["train/loss", "val/loss", "val/exact_match"]


def load_sft_dataset(run: Run, tokenizer: object, files: list[str]) -> SFTDataset:
    d = run.cfg.data
    return SFTDataset(
        resolve_data_files(
            files, run.cache_dir, run.cfg.section(TinyTaskConfig), run.cfg.section(ToolsTaskConfig)
        ),
        tokenizer,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        max_prompt_length=d.max_prompt_length,
        max_response_length=d.max_response_length,
        overlong=d.overlong,
        tools=tool_schemas(load_multi_turn_tools(run.cfg)) if run.cfg.rollout.multi_turn.enable else None,
    )


def micro_batches(examples: list, size: int, pad_id: int, device: torch.device) -> list[SFTBatch]:
    out = []
    for i in range(0, len(examples), size):
        b = collate_sft(examples[i : i + size], pad_id)
        out.append(SFTBatch(**{k: v.to(device) for k, v in vars(b).items()}))
    return out


def num_target_tokens(batch: SFTBatch) -> int:
    # Position t+1 is a target iff loss_mask[t+1] == 1 (logits[:, t] predict input_ids[:, t+1]).
    return int(batch.loss_mask_BT[:, 1:].sum())


def forward_loss(model: torch.nn.Module, batch: SFTBatch, global_tokens: float) -> torch.Tensor:
    logits = model(
        input_ids=batch.input_ids_BT,
        attention_mask=batch.attention_mask_BT,
        position_ids=batch.position_ids_BT,
    ).logits
    loss, _ = masked_cross_entropy(
        logits, batch.input_ids_BT, batch.loss_mask_BT, num_global_tokens=global_tokens
    )
    return loss


@torch.no_grad()
def validation_loss(run: Run, model: torch.nn.Module, ds: SFTDataset, micro: int, pad_id: int) -> float:
    """Mean NLL per response token over the whole validation set, all ranks together.

    FSDP2 runs collectives inside forward, so every rank must run the same number of forwards:
    ranks with a shorter shard repeat an item whose loss is then dropped (weight 0).
    """
    env = run.env
    mine = list(range(env.rank, len(ds), env.world_size))
    per_rank = math.ceil(len(ds) / env.world_size)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine += [0] * (per_rank - len(mine))
    model.eval()
    nll_sum, tokens = 0.0, 0
    for i in range(0, per_rank, micro):
        idx, w = mine[i : i + micro], weights[i : i + micro]
        batch = micro_batches([ds[j] for j in idx], micro, pad_id, env.device)[0]
        keep = torch.tensor(w, device=env.device).unsqueeze(1)
        batch = SFTBatch(
            input_ids_BT=batch.input_ids_BT,
            attention_mask_BT=batch.attention_mask_BT,
            loss_mask_BT=batch.loss_mask_BT * keep.to(batch.loss_mask_BT.dtype),
            position_ids_BT=batch.position_ids_BT,
        )
        n = num_target_tokens(batch)
        nll_sum += float(forward_loss(model, batch, global_tokens=1.0))  # a plain sum
        tokens += n
    model.train()
    totals = all_reduce_sum({"nll": nll_sum, "tokens": tokens}, env.device)
    return totals["nll"] / max(totals["tokens"], 1.0)


def main(cfg: Config) -> None:
    run = start_run(cfg)
    train_sft(run, cfg)


def train_sft(run: Run, cfg: Config, stage: str = "") -> Path:
    """The whole SFT run on an initialized Run; returns the exported HF model directory.

    ``stage`` names a sub-directory of the run's output for metrics and the export (the RL
    recipes' warm-start uses "sft"); "" writes to the output directory itself. A stage saves no
    checkpoints: the RL job that runs it resumes past it from its export.
    """
    env = run.env
    out_dir = run.output_dir / stage

    # Resume: the newest complete checkpoint here (trainer.resume=auto), a path, or none; a second run into
    # a directory that holds one is refused (plan_resume). Rank 0 decides for everyone.
    restarted = restart_count() > 0
    resume_from = None
    if not stage:
        resume_from = plan_resume_all_ranks(cfg.trainer.resume, run.output_dir, restarted=restarted)

    # Model files and tokenizer (built or downloaded by rank 0 first).
    model_dir = resolve_model_path_all_ranks(cfg.model.path, run.cache_dir)
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id

    # Data, and every value derived from its size: checked before the model is built.
    train_ds = load_sft_dataset(run, tokenizer, cfg.data.train_files)
    val_ds = load_sft_dataset(run, tokenizer, cfg.data.val_files) if cfg.data.val_files else None
    derived = derive(cfg, env.world_size, len(train_ds))
    if not stage:  # an RL job's warm-start: its profile_steps are the RL steps, checked there
        check_profile_steps(cfg.logging.profile_steps, derived.total_steps)
    run.log_derived(
        derived,
        stage=stage,
        train_samples=len(train_ds),
        train_filtered_overlong=train_ds.num_filtered,
        val_samples=len(val_ds) if val_ds else 0,
    )
    sampler = run.train_sampler(len(train_ds), derived.per_rank_batch_size)

    # Model: meta -> FSDP2 over the actor mesh -> materialize -> load weights.
    meshes = Placement.colocated(env.world_size, cfg.parallel.dp_replicate).build_meshes(env.device.type)
    spec = model_spec(cfg.model, model_dir, env.device, train=True)
    model = build_fsdp_model(spec, meshes.fsdp("actor"), env.device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, derived.total_steps)

    # Checkpoints hold the model, optimizer, schedule, sampler and RNG (the RL recipes' format, one role).
    role = RoleState(
        "actor",
        True,
        model,
        optimizer,
        scheduler,
        meshes.group("actor"),
        lambda d: write_hf_metadata(model, tokenizer, d),
    )
    checkpointer = Checkpointer(
        checkpoint_root(run.output_dir),
        [role],
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_save,
    )
    start_step = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, [role])
        start_step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        if env.is_main:  # the steps after the checkpoint are logged again
            dropped = rewind_logs(out_dir, start_step)
            log.info(
                "resumed from %s: step %d of %d (%d later log rows dropped)",
                resume_from,
                start_step,
                derived.total_steps,
                dropped,
            )
    elif restarted and env.is_main and not stage:  # died before its first checkpoint: start the logs over
        rewind_logs(out_dir, -1)
    logger = run.metric_logger(derived.total_steps, stage, resume_step=start_step)

    defer = defers_grad_sync(model, cfg.trainer.defer_grad_sync)
    log.info("%s", describe_grad_sync(model, cfg.trainer.defer_grad_sync))
    for step in range(start_step + 1, derived.total_steps + 1):
        t0 = time.perf_counter()
        # logging.profile_steps: the step's training under torch.profiler (in an RL job's warm-start the
        # listed steps are RL steps: none here).
        with profile_step(() if stage else cfg.logging.profile_steps, out_dir, step, env.rank, env.device):
            examples = [train_ds[i] for i in sampler.next_batch()]
            batches = micro_batches(examples, derived.micro_batch_size, pad_id, env.device)

            # Count the valid target tokens of the whole global batch once. Each micro-batch's summed
            # loss is divided by that count, and gradients add up over micro-batches and (FSDP sums them)
            # over ranks to the gradient of the global per-token mean (spmdrl/algos/aggregation.py).
            local = {"tokens": sum(num_target_tokens(b) for b in batches), "seqs": len(examples)}
            local["all_tokens"] = sum(int(b.attention_mask_BT.sum()) for b in batches)
            counts = all_reduce_sum(local, env.device)

            # The loss summed on the device and read once (no host-device sync per micro-batch); the
            # gradients reduced per trainer.defer_grad_sync (spmdrl.models.grad_sync).
            loss_sum = torch.zeros((), device=env.device)
            for i, batch in enumerate(batches):
                gradient_sync(model, defer, last=i == len(batches) - 1)
                loss = forward_loss(model, batch, counts["tokens"])
                loss.backward()
                loss_sum += loss.detach()
            grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
            train_loss = all_reduce_sum_tensors({"loss": loss_sum})["loss"]
            if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                raise FloatingPointError(
                    f"non-finite training loss {train_loss} / grad norm {grad_norm} at step {step}; "
                    f"try a lower optim.lr (now {cfg.optim.lr}) or check the data"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step_s = time.perf_counter() - t0  # without the trace's writing

        metrics = {
            "train/loss": train_loss,
            "train/grad_norm": grad_norm,
            "train/lr": scheduler.get_last_lr()[0],
            "train/epoch": sampler.epoch,
            "perf/tokens_per_s": counts["all_tokens"] / step_s,
            "timing/step_s": step_s,
        }
        validated = (
            val_ds is not None
            and cfg.trainer.val_every > 0
            and (step % cfg.trainer.val_every == 0 or step == derived.total_steps)
        )
        if validated:
            assert val_ds is not None
            metrics["val/loss"] = validation_loss(run, model, val_ds, derived.micro_batch_size, pad_id)
            samples = generate_samples(run, model, tokenizer, val_ds, step)
            if samples:
                metrics["val/exact_match"] = sum(s.reward for s in samples) / len(samples)
                if env.is_main:
                    write_samples(out_dir / "samples.jsonl", samples)
        if step % cfg.trainer.log_every == 0 or validated or step == derived.total_steps:
            logger.log(step, metrics)
        if validated and env.is_main:
            plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png", CURVE_KEYS, title=cfg.name)
        # Logged first, saved second: a kill between the two loses no row (the resumed run logs it again).
        every = cfg.trainer.save_every
        if not stage and (step == derived.total_steps or (every > 0 and step % every == 0)):
            log_saved(
                checkpointer.save(
                    step, {"sampler": sampler.state_dict()}, meta={"total_steps": derived.total_steps}
                )
            )

    log_saved(checkpointer.finish())
    export_dir = out_dir / "hf_model"
    if cfg.trainer.save_hf or stage:
        export_hf(model, tokenizer, export_dir)
    logger.close()
    if env.is_main:
        plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png", CURVE_KEYS, title=cfg.name)
    dist.barrier()
    log.info("SFT done: %d steps, outputs in %s", derived.total_steps, out_dir)
    return export_dir


@torch.no_grad()
def generate_samples(
    run: Run, model: torch.nn.Module, tokenizer: object, ds: SFTDataset, step: int
) -> list[Sample]:
    """Greedy completions of the first logging.samples_per_log validation prompts, each with its reference
    response and ``reward`` 1.0 where the completion equals it exactly (val/exact_match). Every rank
    generates the same prompts (FSDP2 needs the same forwards on every rank)."""
    decode = tokenizer.decode  # type: ignore[attr-defined]
    examples = [ds[i] for i in range(min(run.cfg.logging.samples_per_log, len(ds)))]
    if not examples:
        return []
    starts = [ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.input_ids) for ex in examples]
    prompts = [ex.input_ids[:start] for ex, start in zip(examples, starts, strict=True)]
    completions = greedy_completions(
        model,
        prompts,
        max_new_tokens=run.cfg.data.max_response_length,
        pad_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        device=run.env.device,
        synced=run.env.world_size > 1,
    )
    samples = []
    for ex, start, prompt, completion in zip(examples, starts, prompts, completions, strict=True):
        response = decode(completion, skip_special_tokens=True)
        reference = decode(ex.input_ids[start:], skip_special_tokens=True)
        exact = float(response.strip() == reference.strip())
        samples.append(
            Sample(step, "val", decode(prompt, skip_special_tokens=True), response, reference, exact, "sft")
        )
    return samples


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_sft.py recipe=sft_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
