"""An RL step's models: the actor and, when a KL term needs it, its reference (build_models: a frozen
copy, or under LoRA the actor with its adapters off, spmdrl/rl/reference.py), and
for PPO the critic with its optimizer and schedule (Critic, build_critic), each FSDP2 on its role's ranks
(spmdrl/distributed/placement.py) through spmdrl/models/build.py.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from spmdrl.algos.config import AlgorithmConfig
from spmdrl.distributed.placement import Meshes
from spmdrl.models.build import build_fsdp_model, build_meta_model, model_spec
from spmdrl.models.causal_attention import use_causal_sdpa
from spmdrl.models.config import ModelConfig
from spmdrl.models.varlen import apply_packed_attention
from spmdrl.optim import build_lr_scheduler, build_optimizer
from spmdrl.rl.reference import Reference
from spmdrl.trainer_config import CriticConfig, TrainerConfig

log = logging.getLogger("spmdrl")


def build_models(
    model_cfg: ModelConfig,
    trainer: TrainerConfig,
    algo: AlgorithmConfig,
    device: torch.device,
    meshes: Meshes,
    model_dir: Path,
    *,
    reference: bool = True,
) -> tuple[torch.nn.Module, Reference | None]:
    """The actor (trained) and, when a KL term needs it, the reference, FSDP2 on the actor's ranks: a
    frozen copy of model.path, or under LoRA (model.lora.rank > 0) the actor itself with its adapters off,
    which is the frozen base exactly, at no memory and no second load.

    A rank that does not hold the actor (split placement) gets a meta-device copy of it instead: the
    names and shapes it receives the actor's weights by (weight_sync.Fanout), no memory, no reference.
    ``trainer``: how packed rows attend; ``algo``: whether a KL term needs the reference; ``reference``:
    False builds none whatever ``algo`` says (trainer.val_only, which only generates).
    """
    a = algo
    if not meshes.holds("actor"):
        return build_meta_model(model_spec(model_cfg, model_dir, device, train=False)), None
    actor_spec = model_spec(model_cfg, model_dir, device, train=True)
    # parallel.ep > 1: the experts over their own mesh (spmdrl.models.expert_parallel); the reference keeps
    # them FSDP2-sharded over every rank like the other weights (it only runs no-grad forwards).
    actor = build_fsdp_model(actor_spec, meshes.fsdp("actor"), device, meshes.experts("actor"))
    # Scoring passes without transformers' mask building (spmdrl.models.causal_attention): no host-device
    # sync per forward, and SDPA's flash kernel for padded rows.
    use_causal_sdpa(actor)
    # How packed rows attend (trainer.packed_attention): the actor's and the reference's packed forwards
    # pass the segments' boundaries (spmdrl.models.forward); the critic's keep their mask.
    t = trainer
    attention = dict(packed=t.pack_sequences, device=device, dtype=actor_spec.param_dtype)
    apply_packed_attention(actor, t.packed_attention, **attention)
    # A KL term needs a reference. Under LoRA the actor's frozen base is one already (verl's way): scored
    # with its adapters off, it costs no memory and no second load.
    kl_term, ref = reference and (a.use_kl_loss or a.use_kl_in_reward), None
    if kl_term and model_cfg.lora.enabled:
        ref = Reference(actor, adapters_off=True)
    elif kl_term:
        model = build_fsdp_model(
            model_spec(model_cfg, model_dir, device, train=False), meshes.fsdp("ref"), device
        )
        use_causal_sdpa(model)
        apply_packed_attention(model, t.packed_attention, **attention)
        ref = Reference(model)
    if ref is not None:
        log.info("reference: %s", ref.describe())
    if model_cfg.offload_ref and (ref is None or ref.adapters_off):
        why = "no KL term" if ref is None else "under LoRA the reference is the actor with its adapters off"
        log.warning("model.offload_ref=true does nothing here: %s, so no reference model is built", why)
    return actor, ref


@dataclasses.dataclass
class ModelAndOptimizer:
    """A model with its optimizer and learning-rate schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


Critic = ModelAndOptimizer  # PPO's value model is one


def build_critic(
    critic_cfg: CriticConfig,
    model_cfg: ModelConfig,
    total_steps: int,
    device: torch.device,
    meshes: Meshes,
    path: Path,
) -> Critic:
    """The value model (FSDP2 like the actor, on the critic's ranks) from ``path`` (critic.model_path's
    files, resolved on every rank by the caller, or the actor's), its optimizer and schedule
    (``total_steps``: trainer.total_steps, 0 for a schedule of one step)."""
    spec = model_spec(model_cfg, path, device, train=True, head="value")
    model = build_fsdp_model(spec, meshes.fsdp("critic"), device)
    use_causal_sdpa(model)
    optimizer = build_optimizer(model, critic_cfg.optim)
    return Critic(model, optimizer, build_lr_scheduler(optimizer, critic_cfg.optim, total_steps or 1))
