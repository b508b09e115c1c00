"""Config composition, validation and derivation (no processes, no model)."""

from __future__ import annotations

import pytest

from spmdrl.config import Config, ConfigError, TrainerConfig, derive, derive_rl
from spmdrl.config_loader import load_config


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("optim.schedule=linearish", "optim.schedule"),
        ("data.overlong=truncate", "data.overlong"),
        ("trainer.global_batch_size=0", "trainer.global_batch_size must be > 0"),
        ("parallel.dp_replicate=0", "parallel.dp_replicate"),
        ("tiny_task.correct_fraction=1.5", "correct_fraction"),
        (
            "trainer.defer_grad_sync=sometimes",
            "trainer.defer_grad_sync='sometimes' is not one of auto, true, false",
        ),
    ],
)
def test_bad_values_rejected(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config([override])


@pytest.mark.parametrize("offload", ["offload_params", "offload_optimizer", "offload_ref"])
def test_no_fsdp2_refuses_offload(offload: str) -> None:
    """Host-memory offload is FSDP2's (its CPUOffloadPolicy, DTensor shards): model.fsdp_unit=none with any
    of it fails at load, naming both settings and the fix."""
    with pytest.raises(
        ConfigError, match=rf"fsdp_unit=none .* but model.{offload} is set: .*model.fsdp_unit=auto"
    ):
        load_config(["recipe=grpo_tiny", "model.fsdp_unit=none", f"model.{offload}=true"])
    assert load_config(["recipe=grpo_tiny", "model.fsdp_unit=none"]).model.fsdp_unit == "none"
    with pytest.raises(ConfigError, match="model.fsdp_unit"):
        load_config(["recipe=grpo_tiny", "model.fsdp_unit=nothing"])


def _cfg(global_batch: int, micro: int, total_steps: int = 0, epochs: int = 1) -> Config:
    return Config(
        trainer=TrainerConfig(
            global_batch_size=global_batch,
            micro_batch_size=micro,
            total_steps=total_steps,
            total_epochs=epochs,
        )
    )


def test_derive_batch_arithmetic() -> None:
    d = derive(_cfg(64, 8, epochs=3), world_size=4, num_train_samples=1000)
    assert d.per_rank_batch_size == 16
    assert d.grad_accum_steps == 2
    assert d.steps_per_epoch == 1000 // 64
    assert d.total_steps == 3 * (1000 // 64)
    # an explicit total_steps wins over epochs
    assert derive(_cfg(64, 8, total_steps=7), 4, 1000).total_steps == 7


def test_derive_counts_samples_per_item() -> None:
    # GRPO: 8 prompts per rank, 5 samples each = 40 sequences = 5 micro-batches of 8
    d = derive(_cfg(16, 8), world_size=2, num_train_samples=100, samples_per_item=5)
    assert d.per_rank_batch_size == 8
    assert d.grad_accum_steps == 5


def test_micro_batch_larger_than_a_ranks_batch_means_the_whole_batch() -> None:
    # 64 sequences on 4 ranks: 16 each; a micro-batch of 32 becomes 16 (one micro-batch), not an error.
    d = derive(_cfg(64, 32), world_size=4, num_train_samples=1000)
    assert (d.micro_batch_size, d.grad_accum_steps) == (16, 1)
    assert derive(_cfg(64, 32), world_size=2, num_train_samples=1000).micro_batch_size == 32
    cfg = _cfg(8, 64)
    cfg.rollout.n = 4
    rl = derive_rl(cfg, derive(cfg, world_size=2, num_train_samples=100, samples_per_item=4))
    assert (rl.micro_batch_size, rl.micro_batches_per_mini_batch) == (16, 1)


def test_derive_rejects_indivisible_batch() -> None:
    with pytest.raises(ConfigError, match="not divisible by the data-parallel size 3"):
        derive(_cfg(64, 8), world_size=3, num_train_samples=1000)
    with pytest.raises(ConfigError, match="micro_batch_size=3 must divide"):
        derive(_cfg(64, 3), world_size=2, num_train_samples=1000)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        derive(_cfg(64, 8), world_size=2, num_train_samples=10)


def test_cpu_threads_split_the_usable_cores_over_the_node_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from spmdrl.runtime import cpu_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_threads(0)[0] == 4  # torchrun's OMP_NUM_THREADS=1 would leave 12 of the 16 cores idle
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpu_threads(0)[0] == 1  # more ranks than cores: one each, never 0
    assert cpu_threads(3) == (3, "trainer.cpu_threads")
    with pytest.raises(ConfigError, match=r"trainer\.cpu_threads must be >= 0"):
        load_config(["trainer.cpu_threads=-1"])


# ---------------------------------------------------------------------------------------------- verl 0.9.1 names


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=rloo_vectorized"],
        ["algorithm.adv_estimator=grpo_vectorized"],
        ["algorithm.adv_estimator=optimal_token_baseline"],
        ["algorithm.adv_estimator=tir_optimal_token_baseline"],
        ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format,accuracy]"],
        [
            "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[a,b]",
            "algorithm.gdpo_reward_weights=[1,0.5]",
        ],
        ["algorithm.policy_loss=dppo_tv"],
        ["algorithm.policy_loss=dppo_kl"],
        ["algorithm.policy_loss=dro", "algorithm.dro_beta=0.1"],
        ["algorithm.policy_loss=bypass_mode"],
        ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce"],
        ["algorithm.loss_agg_mode=token-sum"],
        [
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold='0.5_5.0'",
        ],
    ],
)
def test_verl_names_load(overrides: list[str]) -> None:
    load_config(overrides)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["algorithm.policy_loss=dro"], "algorithm.dro_beta > 0"),
        (["algorithm.dro_beta=-1"], "dro_beta must be > 0"),
        (["algorithm.adv_estimator=gdpo"], "needs algorithm.gdpo_reward_keys"),
        (
            ["algorithm.adv_estimator=grpo_vectorized", "algorithm.norm_adv_by_std=false"],
            "has no effect on adv_estimator=grpo_vectorized",
        ),
        (
            [
                "algorithm.adv_estimator=gdpo",
                "algorithm.gdpo_reward_keys=[a]",
                "algorithm.norm_adv_by_std=false",
            ],
            "use adv_estimator=grpo for Dr. GRPO",
        ),
        (
            [
                "algorithm.adv_estimator=gdpo",
                "algorithm.gdpo_reward_keys=[a,b]",
                "algorithm.gdpo_reward_weights=[1]",
            ],
            "1 weights for 2 gdpo_reward_keys",
        ),
        (["algorithm.rollout_correction.rollout_is_threshold=fast"], "rollout_is_threshold"),
        (["algorithm.rollout_correction.rollout_is_threshold='5_0.5'"], "lower bound above"),
        (["algorithm.rollout_correction.loss_type=ppo"], "loss_type"),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "algorithm.policy_loss=gspo"],
            "bypass_mode policy loss",
        ),
        (
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.adv_estimator=optimal_token_baseline",
            ],
            "bypass_mode skips",
        ),
    ],
)
def test_verl_setting_checks(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def test_defaults_follow_verl_where_the_name_is_verls() -> None:
    a = Config().algorithm
    assert a.filter_groups.metric == "reward" and a.filter_groups.max_num_gen_batches == 0
    assert a.rollout_correction.rollout_is_threshold == "2.0" and not a.rollout_correction.bypass_mode
    assert a.rollout_correction.loss_type == "ppo_clip" and a.seq_mean_all_rows
    assert a.dro_beta is None and a.gdpo_reward_keys is None


def test_algorithm_and_reward_names_are_checked_at_load_against_the_registries() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(["algorithm.policy_loss=vanila"])
    msg = str(e.value)
    assert msg.startswith("algorithm.policy_loss='vanila': unknown policy loss. Did you mean 'vanilla'?")
    assert "Registered: vanilla, gspo," in msg and '@register_policy_loss("name")' in msg
    for key, bad in [
        ("algorithm.adv_estimator", "grpoo"),
        ("algorithm.kl_loss_type", "k5"),
        ("algorithm.kl_penalty", "low_var"),
        ("reward.fn", "gsm9k"),
    ]:
        with pytest.raises(ConfigError, match=rf"{key}='{bad}': unknown .*Registered: "):
            load_config([f"{key}={bad}"])


def test_split_batch_arithmetic_is_per_role() -> None:
    cfg = Config()
    cfg.rollout.n, cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size = 4, 6, 4
    d = derive(cfg, world_size=3, num_train_samples=60, samples_per_item=4)
    # 24 sequences: 12 per actor rank (2 ranks), 24 on the one critic rank.
    assert derive_rl(cfg, d, train_ranks=2).per_rank_mini_batch_seqs == 12
    assert derive_rl(cfg, d, train_ranks=1, role="critic").per_rank_mini_batch_seqs == 24
    cfg.trainer.micro_batch_size = 8
    with pytest.raises(ConfigError, match="must divide the actor's per-rank mini-batch of 12"):
        derive_rl(cfg, d, train_ranks=2)
    cfg.trainer.micro_batch_size, cfg.rollout.n = 1, 3
    d = derive(cfg, world_size=3, num_train_samples=60, samples_per_item=3)
    with pytest.raises(ConfigError, match="18 sequences .* does not split evenly over its 4 ranks"):
        derive_rl(cfg, d, train_ranks=4, role="critic")


def test_critic_ranks_must_not_be_negative() -> None:
    from spmdrl.config import validate

    cfg = Config()
    cfg.parallel.critic_ranks = -1
    with pytest.raises(ConfigError, match="parallel.critic_ranks must be >= 0"):
        validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout.parity_tol=-1e-6"], r"rollout\.parity_tol must be >= 0"),
        (["rollout.parity_tol=nan"], r"rollout\.parity_tol must be >= 0"),
        (
            ["recipe=grpo_async_tiny", "rollout.parity_tol=1e-6"],
            r"trainer\.max_staleness=1 .*differ by design",
        ),
        (["rollout.parity_tol=1e-6", "rollout.top_p=0.9"], r"truncated, renormalized distribution"),
        (["rollout.parity_tol=1e-6", "rollout.top_k=20"], r"rollout\.top_k=-1 for a parity run"),
    ],
)
def test_parity_tol_refuses_settings_where_the_two_logprobs_differ_by_design(
    overrides: list[str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def test_parity_tol_takes_a_parity_run() -> None:
    cfg = load_config(["recipe=grpo_tiny", "rollout.parity_tol=1e-6", "rollout.dtype=float32"])
    assert cfg.rollout.parity_tol == 1e-6
    assert load_config(["recipe=grpo_async_tiny", "trainer.max_staleness=0", "rollout.parity_tol=1e-6"])
