"""The SFT stage: supervised fine-tuning as one SPMD program, run alone (recipes/sft.py, recipe=sft_tiny) or
inside another job as its warm-start (spmdrl/supervised/warmstart.py). Read train_sft top to bottom.

The step: each rank takes its shard of the global batch, splits it into micro-batches, and accumulates
gradients of a masked cross-entropy on response tokens only. The loss is normalized by the number of valid
tokens in the *global* batch (counted once per step with one all_reduce), so the result does not depend on
how the batch is split over ranks and micro-batches. Then grad-norm clipping, an AdamW step and the LR
schedule; periodically a validation loss with a few greedy samples (samples.jsonl, curves.png);
checkpoints every trainer.save_every steps and after the last, from which a run resumes exactly (the RL
recipes' format and rules, docs/checkpointing.md; the loop is spmdrl/loop.py's); at the end an HF export.

Deliberately simple: no sequence packing, right-padding to the longest sequence of each micro-batch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from spmdrl import loop
from spmdrl.checkpoint.export import export_hf
from spmdrl.config import Config
from spmdrl.data.sampler import DistributedSampler
from spmdrl.data.sft import SFTDataset
from spmdrl.derived import Derived, derive
from spmdrl.distributed.reduce import all_reduce_sum
from spmdrl.logging.metrics import NullLogger
from spmdrl.logging.plot import plot_curves
from spmdrl.logging.profiler import check_profile_steps, profile_step
from spmdrl.models.grad_sync import gradient_sync
from spmdrl.models.load import load_processor, load_tokenizer, resolve_model_path_all_ranks
from spmdrl.runtime import Run
from spmdrl.supervised.model import TrainedModel, build_trained_model
from spmdrl.supervised.sft_batches import forward_loss, load_sft_dataset, micro_batches, num_target_tokens
from spmdrl.supervised.sft_eval import generate_samples, validation_loss
from spmdrl.trainer_config import VAL_ONLY_STAGE, OptimConfig

log = logging.getLogger("spmdrl")

CURVE_KEYS = ["train/loss", "val/loss", "val/exact_match"]


def train_sft(run: Run, cfg: Config, stage: str = "") -> Path:
    """The whole SFT run on an initialized Run; returns the exported HF model directory (trainer.val_only,
    which trains and exports nothing: the model directory it built from).

    ``stage`` names a sub-directory of the run's output for metrics and the export (the warm-start uses
    "sft"); "" writes to the output directory itself. A stage saves no checkpoints and starts at step 0:
    the job that runs it resumes past it from its export.
    """
    env = run.env
    out_dir = run.output_dir / stage
    # trainer.val_only (a run of its own, never a warm-start): one validation of what it would resume
    # from, logged in output_dir/val_only/ (the training run's logs untouched), then the end.
    val_only = cfg.trainer.val_only and not stage
    log_stage = VAL_ONLY_STAGE if val_only else stage

    # Where the run starts, decided before anything is built (spmdrl/loop.py). A stage starts at step 0;
    # its job starts a restarted stage's logs over (spmdrl/supervised/warmstart.py).
    plan = loop.plan_start(run) if not stage else loop.StartPlan(None, restarted=False)

    # Model files and tokenizer (built or downloaded by rank 0 first).
    model_dir = resolve_model_path_all_ranks(cfg.model.path, run.cache_dir)
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id

    # Data, and every value derived from its size: checked before the model is built.
    processor = load_processor(model_dir, cfg.model.trust_remote_code)  # a VLM's: the prompts' images
    train_ds = load_sft_dataset(run, tokenizer, cfg.data.train_files, processor=processor)
    val_ds = (
        load_sft_dataset(run, tokenizer, cfg.data.val_files, key="data.val_files", processor=processor)
        if cfg.data.val_files
        else None
    )
    derived = derive(cfg, env.world_size, len(train_ds))
    total = derived.total_steps
    if not stage:  # a warm-start's profile_steps are its job's steps, checked there
        check_profile_steps(cfg.logging.profile_steps, total)
    run.log_derived(
        derived,
        stage=log_stage,
        train_samples=len(train_ds),
        train_filtered_overlong=train_ds.num_filtered,
        val_samples=len(val_ds) if val_ds else 0,
    )
    sampler = run.train_sampler(len(train_ds), derived.per_rank_batch_size)

    # The model on every rank; checkpoints hold it with its optimizer, schedule, the sampler and RNG.
    trained = build_trained_model(run, cfg, model_dir, processor or tokenizer, total, "actor")
    start = loop.resume_or_start(run, plan, [trained.role], sampler, total, log_stage, rewind=not val_only)
    if val_only:
        assert val_ds is not None  # checked at config load (recipes/sft.py)
        metrics = validation(run, trained, tokenizer, val_ds, derived, start.step, start.logger)
        start.logger.log(start.step, metrics)
        start.logger.close()
        torch.distributed.barrier()
        log.info("validation only (trainer.val_only) at step %d: %s", start.step, metrics)
        return model_dir

    for step in range(start.step + 1, total + 1):
        t0 = time.perf_counter()
        # logging.profile_steps: the step's training under torch.profiler (in a warm-start the listed
        # steps are its job's: none here).
        with profile_step(() if stage else cfg.logging.profile_steps, out_dir, step, env.rank, env.device):
            train_loss, grad_norm, all_tokens = sft_step(
                trained, cfg.optim, train_ds, sampler, derived, pad_id, env.device, step
            )
            step_s = time.perf_counter() - t0  # without the trace's writing

        metrics = {
            "train/loss": train_loss,
            "train/grad_norm": grad_norm,
            "train/lr": trained.scheduler.get_last_lr()[0],
            "train/epoch": sampler.epoch,
            "perf/tokens_per_s": all_tokens / step_s,
            "timing/step_s": step_s,
        }
        validated = val_ds is not None and loop.validation_due(step, cfg.trainer.val_every, total)
        if validated:
            assert val_ds is not None
            metrics.update(validation(run, trained, tokenizer, val_ds, derived, step, start.logger))
        if validated or loop.due(step, cfg.trainer.log_every, total):
            start.logger.log(step, metrics)
        if validated and env.is_main:
            plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png", CURVE_KEYS, title=cfg.name)
        # Logged first, saved second (loop.save).
        if not stage and loop.due(step, cfg.trainer.save_every, total):
            loop.save(trained.checkpointer, step, sampler, meta={"total_steps": total})

    export_dir = out_dir / "hf_model"

    def export() -> None:
        if cfg.trainer.save_hf or stage:
            # A warm-start stage's export is the RL run's starting point, read into its float32 master
            # weights: written in float32, so the handoff rounds nothing.
            export_hf(
                trained.model,
                processor or tokenizer,  # a VLM's processor: its tokenizer and image processor
                export_dir,
                dtype="float32" if stage else cfg.trainer.export_dtype,
            )

    def curves() -> None:
        plot_curves(out_dir / "metrics.jsonl", out_dir / "curves.png", CURVE_KEYS, title=cfg.name)

    loop.finish(run, trained.checkpointer, start.logger, outputs=export, curves=curves)
    log.info("SFT done: %d steps, outputs in %s", total, out_dir)
    return export_dir


def validation(
    run: Run,
    trained: TrainedModel,
    tokenizer: object,
    val_ds: SFTDataset,
    derived: Derived,
    step: int,
    logger: NullLogger,
) -> dict[str, float]:
    """The held-out loss, and greedy samples of the first prompts with their exact match (to ``logger``:
    samples.jsonl, the trackers' tables, rank 0's). Every rank calls it."""
    pad_id = tokenizer.pad_token_id  # type: ignore[attr-defined]
    metrics = {"val/loss": validation_loss(run, trained.model, val_ds, derived.micro_batch_size, pad_id)}
    samples = generate_samples(run, trained.model, tokenizer, val_ds, step)
    if samples:
        metrics["val/exact_match"] = sum(s.reward for s in samples) / len(samples)
        logger.log_samples(samples)
    return metrics


def sft_step(
    trained: TrainedModel,
    optim: OptimConfig,
    ds: SFTDataset,
    sampler: DistributedSampler,
    derived: Derived,
    pad_id: int,
    device: torch.device,
    step: int,
) -> tuple[float, float, float]:
    """One optimizer step on the sampler's next batch; returns the loss (the global per-token mean), the
    gradient norm before clipping, and the tokens of the global batch, padding aside."""
    examples = [ds[i] for i in sampler.next_batch()]
    batches = micro_batches(examples, derived.micro_batch_size, pad_id, device)

    # Count the valid target tokens of the whole global batch once. Each micro-batch's summed loss is
    # divided by that count, and gradients add up over micro-batches and (FSDP sums them) over ranks to
    # the gradient of the global per-token mean (spmdrl/algos/aggregation.py).
    local = {"tokens": sum(num_target_tokens(b) for b in batches), "seqs": len(examples)}
    local["all_tokens"] = sum(int(b.attention_mask_BT.sum()) for b in batches)
    counts = all_reduce_sum(local, device)

    # The loss summed on the device and read once (no host-device sync per micro-batch); the gradients
    # reduced per trainer.defer_grad_sync (spmdrl.models.grad_sync).
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        gradient_sync(trained.model, trained.defer_grad_sync, last=i == len(batches) - 1)
        loss = forward_loss(trained.model, batch, counts["tokens"])
        loss.backward()
        loss_sum += loss.detach()
    totals, grad_norm = trained.optimizer_step({"loss": loss_sum}, optim, step)
    return totals["loss"], grad_norm, counts["all_tokens"]
