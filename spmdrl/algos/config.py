"""The ``algorithm`` section: the advantage estimator, the policy and KL losses and their parameters (verl's
names), the rollout correction and DAPO's dynamic sampling, and the checks of those values alone.

The names a field takes come from the registries in this package (``registered``/``choice`` fields), read
when the config is validated, so this module imports none of them (they import torch)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from spmdrl.config_section import choice, registered, registry_names
from spmdrl.errors import ConfigError


@dataclass
class KLCtrlConfig:
    """verl's algorithm.kl_ctrl: the coefficient of the KL penalty in the reward."""

    # "fixed" or "adaptive" (moves kl_coef towards target_kl over horizon samples).
    type: str = choice("fixed", registry_names("spmdrl.algos.kl_control", "KL_CTRL_TYPES"))
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction (spmdrl/algos/correction.py, docs/algorithms.md)."""

    # "": off; "token" or "sequence": importance weights exp(trainer - engine logprob).
    rollout_is: str = choice("", ("", "token", "sequence"))
    # A number U: the weights are truncated at U (TIS). "L_U" (quoted: YAML reads 0.5_5.0 as 0.55):
    # weights outside [L, U] are set to 0 (IcePop). verl's str | float, kept as a string here.
    rollout_is_threshold: str = "2.0"
    rollout_is_batch_normalize: bool = False
    # "": off; comma-joined rejection options (token_k1, seq_mean_k3, ...) and their thresholds.
    rollout_rs: str = ""
    rollout_rs_threshold: str = ""
    # verl's bypass mode: the engine's logprobs are the old policy (no old-logprob pass), and the
    # correction above runs inside the policy loss (policy_loss becomes "bypass_mode") with loss_type
    # "ppo_clip" (PPO's ratio against the rollout policy) or "reinforce" (IS-weighted policy gradient).
    bypass_mode: bool = False
    loss_type: str = choice("ppo_clip", registry_names("spmdrl.algos.correction", "BYPASS_LOSS_TYPES"))

    @property
    def enabled(self) -> bool:
        """Whether the recipe corrects the batch before the update (bypass mode corrects in the loss)."""
        return bool(self.rollout_is or self.rollout_rs) and not self.bypass_mode

    def check(self) -> None:
        from spmdrl.algos.correction import parse_is_threshold, parse_rs_thresholds

        try:
            parse_is_threshold(self.rollout_is_threshold)
        except ValueError as e:
            raise ConfigError(f"algorithm.rollout_correction: {e}") from None
        if not self.rollout_rs:
            return
        if not self.rollout_rs_threshold:
            raise ConfigError("algorithm.rollout_correction.rollout_rs needs rollout_rs_threshold")
        try:
            parse_rs_thresholds(
                [o.strip() for o in self.rollout_rs.split(",") if o.strip()], self.rollout_rs_threshold
            )
        except ValueError as e:
            raise ConfigError(f"algorithm.rollout_correction: {e}") from None


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl: algorithm.filter_groups): drop prompts whose samples all got the
    same ``metric`` (no learning signal) and generate more until every rank has its share."""

    enable: bool = False
    # "reward" (verl 0.9.1's: the reward the advantages start from, overlong penalty included, before any
    # KL penalty), "acc" (reward >= 1), "score" (the reward function's score) or "seq_final_reward"
    # (after shaping, the same as "reward" here: the KL penalty comes later).
    metric: str = choice("reward", ("reward", "acc", "score", "seq_final_reward"))
    # Generation batches per step before giving up with an error; 0: no limit (verl's default; verl 0.9.1
    # ignores a positive value and never gives up, spmdrl stops with an error naming this key).
    max_num_gen_batches: int = 0


@dataclass
class AlgorithmConfig:
    """GRPO / PPO loss settings (defaults follow verl's GSM8K GRPO example)."""

    # verl's name (docs/algorithms.md): grpo, grpo_vectorized, rloo, rloo_vectorized, reinforce_plus_plus,
    # reinforce_plus_plus_baseline, remax (one extra greedy rollout per prompt as the baseline), opo,
    # grpo_passk, gpg, gdpo (gdpo_reward_keys below), optimal_token_baseline, tir_optimal_token_baseline
    # (both add the old-logprob pass, with the sum of squared probabilities); gae needs a critic. Or one
    # of your own, by import path or registered with @register_adv_estimator (docs/algorithms.md).
    adv_estimator: str = registered("grpo", "spmdrl.algos.advantages", "ADV_ESTIMATORS")
    # False gives Dr. GRPO (no division by the group's reward std); verl's norm_adv_by_std_in_grpo.
    norm_adv_by_std: bool = True
    # Discount and GAE lambda (gae, reinforce_plus_plus).
    gamma: float = 1.0
    lam: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum" or "seq-mean-token-sum-norm"
    # (Dr. GRPO). The policy loss, entropy bonus and KL loss all use it (sapo and geo_mean's policy term
    # excepted: verl reduces it with seq-mean-token-mean).
    loss_agg_mode: str = choice("token-mean", registry_names("spmdrl.algos.aggregation", "AGG_MODES"))
    # seq-mean-token-sum-norm's constant divisor per sequence; 0: data.max_response_length (the width of
    # verl's response mask, its default).
    loss_scale_factor: float = 0.0
    # seq-mean-* modes: the mean is over every row of the mini-batch, a row whose tokens were all masked
    # (rejected by the rollout correction) included, as verl's trainer (global_batch_size = the mini-batch's
    # rows); false: over the rows with a valid token (verl's agg_loss without global_batch_size).
    seq_mean_all_rows: bool = True
    # verl's actor.policy_loss.loss_mode: vanilla (PPO clip + dual-clip), gspo, cispo, gpg, clip_cov,
    # kl_cov, geo_mean, sapo, dppo_tv, dppo_kl, dro, bypass_mode (docs/algorithms.md); and the parameters
    # those read, under verl's names. Or one of your own, by import path or registered with
    # @register_policy_loss (docs/algorithms.md); the loss is called with params=this section.
    policy_loss: str = registered("vanilla", "spmdrl.algos.policy_losses", "POLICY_LOSSES")
    clip_ratio_c: float = 3.0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    # dro's quadratic log-ratio penalty (verl: actor.policy_loss.dro_beta); must be > 0 for dro.
    dro_beta: float | None = None
    # gdpo: the reward function's extra keys holding the reward components (its returned dict), each
    # normalized within its group on its own, and their weights (None: all 1).
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    # kl/k1, abs, mse/k2, low_var_kl/k3, and each with "+" (its value, k2's gradient).
    # Or one of your own, by import path or registered with @register_kl_estimator (docs/algorithms.md).
    kl_loss_type: str = registered("low_var_kl", "spmdrl.algos.kl", "KL_ESTIMATORS")
    # KL to the reference folded into the reward (verl's use_kl_in_reward), estimator kl_penalty, with a
    # fixed or adaptive coefficient (kl_ctrl).
    use_kl_in_reward: bool = False
    kl_penalty: str = registered("kl", "spmdrl.algos.kl", "KL_ESTIMATORS")
    kl_ctrl: KLCtrlConfig = field(default_factory=lambda: KLCtrlConfig())
    entropy_coeff: float = 0.0
    ppo_epochs: int = 1
    # The old policy's logprobs: auto computes them in a no-grad pass of their own only where the update's
    # own forward is not the old policy (several optimizer steps) or something reads them before the
    # update (rollout correction, the KL in the reward, the optimal token baseline); otherwise the update's
    # first forward, detached, is them (the same numbers, one forward fewer). always: the pass every step,
    # as verl does (outside its rollout-correction bypass mode, where the engine's are the old ones).
    recompute_old_logprobs: str = choice("auto", ("auto", "always"))
    # Prompts per optimizer step over the whole job (each brings rollout.n samples); 0: the whole batch.
    ppo_mini_batch_size: int = 0
    # Importance weights and rejection for the engine-vs-trainer mismatch (verl's rollout correction).
    rollout_correction: RolloutCorrectionConfig = field(default_factory=lambda: RolloutCorrectionConfig())
    filter_groups: FilterGroupsConfig = field(default_factory=lambda: FilterGroupsConfig())

    def check(self) -> None:
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ConfigError(
                f"algorithm.gamma and algorithm.lam must be in [0, 1], got {self.gamma}, {self.lam}"
            )
        if self.loss_scale_factor < 0:
            raise ConfigError(f"algorithm.loss_scale_factor must be >= 0, got {self.loss_scale_factor}")
        rc = self.rollout_correction
        rc.check()
        if rc.bypass_mode and self.policy_loss not in ("vanilla", "bypass_mode"):
            raise ConfigError(
                f"algorithm.rollout_correction.bypass_mode=true runs the bypass_mode policy loss (its loss_type="
                f"{rc.loss_type!r}) in place of algorithm.policy_loss={self.policy_loss!r}, which verl "
                "would ignore; set algorithm.policy_loss=vanilla or turn bypass_mode off"
            )
        self._check_loss_settings()
        if self.clip_ratio_c <= 1.0:
            raise ConfigError(
                f"algorithm.clip_ratio_c must be > 1 (dual-clip bound), got {self.clip_ratio_c}"
            )
        if self.ppo_epochs <= 0:
            raise ConfigError(f"algorithm.ppo_epochs must be > 0, got {self.ppo_epochs}")
        if self.ppo_mini_batch_size < 0:
            raise ConfigError("algorithm.ppo_mini_batch_size must be >= 0 (0: the whole batch)")

    def _check_loss_settings(self) -> None:
        """The settings a policy loss or advantage estimator needs (dro's beta, gdpo's reward keys), and the
        ranges of the parameters the policy losses read (spmdrl.algos.policy_losses.PolicyLossParams)."""
        from spmdrl.algos.advantages import adv_estimator

        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ConfigError(
                f"algorithm.clip_ratio_low and clip_ratio_high must be >= 0, got {self.clip_ratio_low}, "
                f"{self.clip_ratio_high}"
            )
        if self.clip_cov_ratio <= 0 or self.kl_cov_ratio <= 0:
            raise ConfigError(
                f"algorithm.clip_cov_ratio and kl_cov_ratio must be > 0, got {self.clip_cov_ratio}, {self.kl_cov_ratio}"
            )
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ConfigError(
                f"algorithm.tau_pos and tau_neg must be > 0, got {self.tau_pos}, {self.tau_neg}"
            )
        if self.policy_loss == "dro" and not (self.dro_beta is not None and self.dro_beta > 0):
            raise ConfigError(f"algorithm.policy_loss=dro needs algorithm.dro_beta > 0, got {self.dro_beta}")
        if self.dro_beta is not None and self.dro_beta <= 0:
            raise ConfigError(f"algorithm.dro_beta must be > 0 (or null), got {self.dro_beta}")
        if adv_estimator(self.adv_estimator).needs_sum_pi_squared and self.rollout_correction.bypass_mode:
            raise ConfigError(
                f"algorithm.adv_estimator={self.adv_estimator} reads the old policy's sum of squared probabilities, "
                "from the old-logprob pass that algorithm.rollout_correction.bypass_mode skips (verl fails too)"
            )
        if self.adv_estimator in ("grpo_vectorized", "gdpo") and not self.norm_adv_by_std:
            # verl 0.9.1's trainer hands norm_adv_by_std_in_grpo to grpo only: these two always divide by the
            # group's std there, and here. A setting that would be silently ignored is an error instead.
            raise ConfigError(
                f"algorithm.norm_adv_by_std=false has no effect on adv_estimator={self.adv_estimator} (verl 0.9.1 "
                "ignores it too: it always divides by the group's std): use adv_estimator=grpo for Dr. GRPO's "
                "r - mean, or keep norm_adv_by_std=true"
            )
        if self.adv_estimator == "gdpo" and not self.gdpo_reward_keys:
            raise ConfigError(
                "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the keys of the reward "
                "components the reward function returns in its dict (e.g. [format_reward, accuracy_reward])"
            )
        keys, weights = self.gdpo_reward_keys or [], self.gdpo_reward_weights
        if weights is not None and len(weights) != len(keys):
            raise ConfigError(
                f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(keys)} gdpo_reward_keys"
            )


@dataclass
class TeacherConfig:
    """On-policy distillation (docs/algorithms.md#on-policy-distillation): a frozen teacher scores every token
    the actor sampled, and the actor is trained to lower the per-token reverse KL to it. The teacher is one
    more frozen role on the actor's ranks, as the reference is (spmdrl/rl/teacher.py), or on ranks of its
    own (parallel.teacher_ranks). verl's
    ``distillation.teacher_model.model_path`` (here ``path``) and ``distillation.distillation_loss.*``
    (``loss_mode``, ``use_policy_gradient``, ``use_task_rewards``, ``distillation_loss_coef``,
    ``loss_max_clamp``, ``log_prob_min_clamp``), under their names."""

    # "": no teacher (distillation off). Otherwise what model.path accepts: a local HF directory, a hub id, a
    # packaged model, or a built-in one (tiny-teacher: a wider tiny Qwen2 trained on the tiny task, built
    # once and cached). Its architecture may differ from the actor's; its tokenizer must be the actor's.
    path: str = ""
    # The teacher's parameter dtype for its no-grad pass. auto: model.param_dtype's.
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))
    # The teacher's parameters in host memory, streamed to the GPU layer by layer for its pass (as
    # model.offload_ref does for the reference). On a CPU trainer it moves nothing.
    offload: bool = False
    # The per-token estimator of KL(student || teacher), by spmdrl.algos.kl's names (verl's loss_mode reuses
    # its kl_penalty's): k1 (log pi - log pi_T: the reverse KL's unbiased estimate on the student's own
    # samples), k3 / low_var_kl, k2 / mse, abs, or one registered with @register_kl_estimator.
    loss_mode: str = registered("k1", "spmdrl.algos.kl", "KL_ESTIMATORS")
    # true (Thinking Machines' formulation, verl's default): the negated per-token estimate is a dense
    # advantage that the policy loss (algorithm.policy_loss, importance-sampled against the old policy)
    # trains on; false: the estimate is a loss term of its own, backpropagated directly (use k3 or k2: k1's
    # gradient does not depend on the teacher).
    use_policy_gradient: bool = True
    # false: distillation alone (the task reward is logged, not trained on); true: the task's advantages
    # (algorithm.adv_estimator) plus distillation_loss_coef x the distillation's.
    use_task_rewards: bool = False
    # The distillation term's weight when mixed with the task reward (use_task_rewards); 1 without it.
    distillation_loss_coef: float = 1.0
    # Each token's estimate is clamped to at most this (null: no clamp), and both logprobs to at least
    # log_prob_min_clamp first (null: none), so that one token the teacher finds impossible does not
    # dominate the batch.
    loss_max_clamp: float | None = 10.0
    log_prob_min_clamp: float | None = -10.0

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    @property
    def coef(self) -> float:
        """The distillation term's weight (verl: distillation_loss_coef only with the task reward)."""
        return self.distillation_loss_coef if self.use_task_rewards else 1.0

    def check(self) -> None:
        if not self.enabled:
            # Distillation settings without a teacher would be silently ignored: refused instead.
            changed = [
                f.name for f in fields(self) if f.name != "path" and getattr(self, f.name) != f.default
            ]
            if changed:
                raise ConfigError(
                    f"{', '.join(f'teacher.{k}' for k in changed)} set, but teacher.path is empty: on-policy "
                    "distillation needs a teacher; set teacher.path (a model directory sharing the actor's "
                    "tokenizer, or tiny-teacher with model.path=tiny, as in recipe=opd_tiny), or drop the setting"
                )
            return
        if not self.use_policy_gradient and self.loss_mode in ("k1", "kl"):
            raise ConfigError(
                f"teacher.loss_mode={self.loss_mode} with teacher.use_policy_gradient=false: the gradient of "
                "log pi - log pi_T does not depend on the teacher, so the loss would teach nothing; use "
                "teacher.loss_mode=k3 (or k2), or use_policy_gradient=true"
            )
        if self.distillation_loss_coef <= 0:
            raise ConfigError(
                f"teacher.distillation_loss_coef must be > 0, got {self.distillation_loss_coef}; to train on "
                "the task reward alone, set teacher.path='' (no teacher)"
            )
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            raise ConfigError(f"teacher.loss_max_clamp must be > 0 or null, got {self.loss_max_clamp}")
        if self.log_prob_min_clamp is not None and self.log_prob_min_clamp >= 0:
            raise ConfigError(
                f"teacher.log_prob_min_clamp must be < 0 (a log-probability) or null, got {self.log_prob_min_clamp}"
            )
