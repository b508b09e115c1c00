"""One model trained on every rank (the SFT stage's, the reward model's): built as the RL recipes' actor is,
its optimizer step, and its checkpoint role (the RL recipes' checkpoint format, one role)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from spmdrl.checkpoint.checkpointer import Checkpointer, RoleState, checkpoint_root
from spmdrl.checkpoint.export import write_hf_metadata
from spmdrl.config import Config
from spmdrl.distributed.placement import Placement
from spmdrl.distributed.reduce import all_reduce_sum_tensors
from spmdrl.models.build import build_fsdp_model, model_spec
from spmdrl.models.grad_sync import defers_grad_sync, describe_grad_sync
from spmdrl.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from spmdrl.runtime import Run
from spmdrl.trainer_config import OptimConfig

log = logging.getLogger("spmdrl")


@dataclass
class TrainedModel:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    role: RoleState  # what a checkpoint holds of it
    checkpointer: Checkpointer
    defer_grad_sync: bool  # trainer.defer_grad_sync resolved for the model (spmdrl.models.grad_sync)

    def optimizer_step(
        self, sums: dict[str, torch.Tensor], optim: OptimConfig, step: int
    ) -> tuple[dict[str, float], float]:
        """After the step's backward passes: clips the gradients, reads ``sums`` (the micro-batches' on the
        device, summed over ranks in one all-reduce: one read per step), stops on a non-finite loss or norm,
        then the optimizer and the schedule step. Returns the summed values and the norm before clipping."""
        grad_norm = clip_grad_norm(self.model, optim.grad_clip)
        totals = all_reduce_sum_tensors(sums)
        if not (math.isfinite(totals["loss"]) and math.isfinite(grad_norm)):
            raise FloatingPointError(
                f"non-finite training loss {totals['loss']} / grad norm {grad_norm} at step {step}; "
                f"try a lower optim.lr (now {optim.lr}) or check the data"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return totals, grad_norm


def build_trained_model(
    run: Run, cfg: Config, model_dir: Path, tokenizer: object, total_steps: int, role: str, head: str = "lm"
) -> TrainedModel:
    """``model_dir``'s model (``head``: "lm", or "reward" for a scalar head) sharded over every rank:
    meta -> FSDP2 -> materialize -> load weights; its optimizer and schedule (optim.*), and a checkpointer
    that saves it as ``role`` into the run's checkpoints (trainer.keep_checkpoints, trainer.async_save).
    ``cfg``: the stage's config (a warm-start's is not the run's, spmdrl/supervised/warmstart.py)."""
    env = run.env
    meshes = Placement.colocated(env.world_size, cfg.parallel.dp_replicate).build_meshes(env.device.type)
    spec = model_spec(cfg.model, model_dir, env.device, train=True, head=head)
    model = build_fsdp_model(spec, meshes.fsdp("actor"), env.device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, total_steps)
    state = RoleState(
        role,
        True,
        model,
        optimizer,
        scheduler,
        meshes.group("actor"),
        lambda d: write_hf_metadata(model, tokenizer, d),
    )
    checkpointer = Checkpointer(
        checkpoint_root(run.output_dir),
        [state],
        keep=cfg.trainer.keep_checkpoints,
        async_save=cfg.trainer.async_save,
    )
    defer = defers_grad_sync(model, cfg.trainer.defer_grad_sync)
    log.info("%s", describe_grad_sync(model, cfg.trainer.defer_grad_sync))
    return TrainedModel(model, optimizer, scheduler, state, checkpointer, defer)
