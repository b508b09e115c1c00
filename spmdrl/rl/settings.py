"""What an RL component reads of the job's config, gathered from the whole :class:`~spmdrl.config.Config`
in one place.

The functions below the recipes take the sections they read (``update_critic(settings, cfg.critic, ...)``),
or, where they read several, a small dataclass of exactly those, built here once by the job: a signature
says what its function reads, and a whole-job config goes only to the code that plans the job.
"""

from __future__ import annotations

from spmdrl.algos.policy_losses import POLICY_LOSSES
from spmdrl.config import Config
from spmdrl.rl.samples import RewardSettings
from spmdrl.rl.update import UpdateSettings, policy_loss_name


def update_settings(cfg: Config) -> UpdateSettings:
    """The trainer's passes' settings (spmdrl.rl.update), with the values of the config section the policy
    loss declared, if it declared one (``@register_policy_loss(..., section=...)``)."""
    loss_fn = POLICY_LOSSES.get(policy_loss_name(cfg.algorithm))
    return UpdateSettings(
        algorithm=cfg.algorithm,
        trainer=cfg.trainer,
        optim=cfg.optim,
        model=cfg.model,
        temperature=cfg.rollout.temperature,
        max_response_length=cfg.data.max_response_length,
        loss_section=cfg.section(loss_fn.section) if loss_fn.section is not None else None,
        teacher=cfg.teacher,
    )


def reward_settings(cfg: Config) -> RewardSettings:
    """What the stop on a step's failed rewards reads (spmdrl.rl.samples.check_reward_errors)."""
    return RewardSettings(cfg.reward, cfg.reward_model, cfg.model.param_dtype)
