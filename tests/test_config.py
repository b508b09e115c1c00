"""Config composition, validation and derivation (no processes, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.config import Config, ConfigError, TrainerConfig, derive, derive_rl
from spmdrl.config_loader import available_recipes, load_config
from spmdrl.data.tiny_task import TinyTaskConfig
from spmdrl.data.tools_task import ToolsTaskConfig


def test_recipe_and_overrides_compose() -> None:
    cfg = load_config(
        ["recipe=sft_tiny", "optim.lr=2e-5", "trainer.total_steps=50", "tiny_task.num_train=64"]
    )
    assert isinstance(cfg, Config)
    assert cfg.name == "sft_tiny" and cfg.entry == "sft"
    assert cfg.optim.lr == pytest.approx(2e-5)
    assert cfg.trainer.total_steps == 50
    assert cfg.section(TinyTaskConfig).num_train == 64
    # recipe values override the dataclass defaults
    assert cfg.optim.schedule == "cosine"


def test_default_recipe_is_grpo_tiny() -> None:
    cfg = load_config([])
    assert (cfg.name, cfg.entry) == ("grpo_tiny", "grpo")
    assert {"sft_tiny", "grpo_tiny", "grpo_gsm8k", "dapo_tiny", "ppo_tiny", "ppo_gsm8k"} <= set(
        available_recipes()
    )


@pytest.mark.parametrize(
    "recipe", ["grpo_tiny", "grpo_gsm8k", "dapo_tiny", "ppo_tiny", "ppo_gsm8k", "sft_tiny"]
)
def test_every_shipped_recipe_loads_and_validates(recipe: str) -> None:
    cfg = load_config([f"recipe={recipe}"])  # load_config validates
    assert cfg.name == recipe
    if recipe.startswith("ppo"):
        assert cfg.algorithm.adv_estimator == "gae"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lrr=1e-5", "Did you mean 'optim.lr'"),
        ("trainer.total_step=3", "trainer.total_steps"),
        ("optimm.lr=1", "Valid keys at the top level"),
        ("optim.lr.x=1", "has no sub-keys"),
    ],
)
def test_unknown_key_names_valid_choices(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config([override])


@pytest.mark.parametrize(
    ("override", "new"),
    [("data.tiny.num_train=64", "tiny_task.num_train"), ("data.tiny_tools.seed=7", "tools_task.seed")],
)
def test_moved_task_keys_name_their_new_key(override: str, new: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown config key .* now: '{new}'"):
        load_config([override])


def test_task_sections_without_importing_the_entry(tmp_path: Path) -> None:
    # The built-in tasks' sections exist whatever the recipe imports (import_entry_module=False: a forked
    # recipe run as a script), on the command line and in a YAML, and are saved with the config.
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults: [grpo_tools_tiny, _self_]\ntiny_task:\n  max_operand: 7\n")
    cfg = load_config([f"recipe={recipe}", "tools_task.seed=7"], import_entry_module=False)
    assert cfg.section(TinyTaskConfig).max_operand == 7 and cfg.section(ToolsTaskConfig).seed == 7
    assert cfg.section(ToolsTaskConfig).num_train == 4000  # grpo_tools_tiny's value


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optim.lr=fast", "optim.lr"),
        ("trainer.micro_batch_size=1.5", "trainer.micro_batch_size"),
        ("logging.tensorboard=maybe", "logging.tensorboard"),
    ],
)
def test_wrong_type_names_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([override])


def test_unknown_recipe_lists_recipes() -> None:
    with pytest.raises(ConfigError, match="Available recipes: .*sft_tiny"):
        load_config(["recipe=sft_tin"])


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("optim.schedule=linearish", "optim.schedule"),
        ("data.overlong=truncate", "data.overlong"),
        ("trainer.global_batch_size=0", "trainer.global_batch_size must be > 0"),
        ("parallel.dp_replicate=0", "parallel.dp_replicate"),
        ("tiny_task.correct_fraction=1.5", "correct_fraction"),
    ],
)
def test_bad_values_rejected(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config([override])


def test_unparseable_argument() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["lr"])


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


def test_names_registered_before_load_and_import_paths_are_accepted(tmp_path) -> None:
    from spmdrl.algos.policy_losses import POLICY_LOSSES, register_policy_loss, vanilla_policy_loss

    # Registered before the config is validated (as a recipe's entry file is imported): accepted.
    register_policy_loss("spmdrl_test_config_loss")(vanilla_policy_loss)
    try:
        cfg = load_config(["algorithm.policy_loss=spmdrl_test_config_loss"])
        assert cfg.algorithm.policy_loss == "spmdrl_test_config_loss"
    finally:
        POLICY_LOSSES.unregister("spmdrl_test_config_loss")
    # By file path: imported at load; one that does not resolve names the module and attribute.
    (tmp_path / "my_estimators.py").write_text("def mine(inputs):\n    return inputs, inputs\n")
    spec = f"{tmp_path}/my_estimators.py:mine"
    assert load_config([f"algorithm.adv_estimator={spec}"]).algorithm.adv_estimator == spec
    with pytest.raises(ConfigError, match=r"module '.*my_estimators.py' has no attribute 'nope'.*mine"):
        load_config([f"algorithm.adv_estimator={tmp_path}/my_estimators.py:nope"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["recipe=grpo_tiny", "algorithm.adv_estimator=gae"], r"needs a critic.*set entry: ppo"),
        (["recipe=ppo_tiny", "algorithm.adv_estimator=grpo"], r"trains a critic.*or entry: grpo for grpo"),
        (
            ["recipe=ppo_tiny", "algorithm.filter_groups.enable=true"],
            r"dynamic sampling\) runs in entry: grpo",
        ),
    ],
)
def test_a_setting_the_recipe_would_not_run_fails_at_load(overrides: list[str], match: str) -> None:
    """Each recipe's check_config, run by the loader after validation: not ignored, not a late failure."""
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)


def test_a_forked_recipe_keeps_its_check(tmp_path) -> None:  # noqa: ANN001
    """The check lives in the recipe file, so a copy of recipes/grpo.py run by path still refuses a critic."""
    import shutil

    shutil.copy(Path(__file__).parents[1] / "recipes" / "grpo.py", tmp_path / "my_grpo.py")
    (tmp_path / "my.yaml").write_text("defaults: [grpo_tiny, _self_]\nentry: my_grpo.py\n")
    with pytest.raises(ConfigError, match=r"needs a critic, and this recipe \(.*my_grpo.py\) trains none"):
        load_config([f"recipe={tmp_path / 'my.yaml'}", "algorithm.adv_estimator=gae"])
