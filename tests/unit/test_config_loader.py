"""Config loading (spmdrl/config_loader.py): recipes, overrides, errors that name the key; and a fork as
files in any directory (issue 18's contract): a recipe YAML by path that starts from a shipped recipe,
an entry file beside it, the recipe's own config section, its own policy loss (small entry files, no model)."""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from spmdrl import config as config_module
from spmdrl.config import Config, ConfigError
from spmdrl.config_loader import available_recipes, import_entry, load_config, to_yaml
from spmdrl.data.tiny_task import TinyTaskConfig
from spmdrl.data.tools_task import ToolsTaskConfig
from tests.unit.forks import ENTRY, FORK_YAML, fork_files


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


def test_a_replaced_key_says_what_to_write_instead() -> None:
    with pytest.raises(ConfigError, match=r"'logging.tensorboard' is gone: .*logging.backends=\[\] for none"):
        load_config(["logging.tensorboard=false"])


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
        ("logging.progress_bar=maybe", "logging.progress_bar"),
    ],
)
def test_wrong_type_names_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([override])


def test_unknown_recipe_lists_recipes() -> None:
    with pytest.raises(ConfigError, match="Available recipes: .*sft_tiny"):
        load_config(["recipe=sft_tin"])


def test_unparseable_argument() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["lr"])


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

    shutil.copy(Path(__file__).parents[2] / "recipes" / "grpo.py", tmp_path / "my_grpo.py")
    (tmp_path / "my.yaml").write_text("defaults: [grpo_tiny, _self_]\nentry: my_grpo.py\n")
    with pytest.raises(ConfigError, match=r"needs a critic, and this recipe \(.*my_grpo.py\) trains none"):
        load_config([f"recipe={tmp_path / 'my.yaml'}", "algorithm.adv_estimator=gae"])


REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("restore_sections")


def test_recipe_yaml_by_path_starts_from_a_shipped_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fork_files(tmp_path, FORK_YAML)
    shipped = load_config(["recipe=grpo_tiny"], import_entry_module=False)
    for recipe in (str(path), os.path.relpath(path, tmp_path.parent)):  # absolute, and relative to the cwd
        monkeypatch.chdir(tmp_path.parent)
        cfg = load_config([f"recipe={recipe}", "trainer.total_steps=3"])
        assert cfg.optim.lr == 0.5 and cfg.trainer.total_steps == 3  # the YAML's key, the command line's
        assert (
            cfg.rollout == shipped.rollout and cfg.warmstart == shipped.warmstart
        )  # the rest is grpo_tiny's
        assert cfg.name == "my_grpo"  # the file's name: the run goes to outputs/my_grpo/
        assert cfg.entry == str(tmp_path / "my_recipe.py")  # relative to the YAML, saved absolute


def test_paths_with_spaces_and_override_characters(tmp_path: Path) -> None:
    odd = tmp_path / "my fork, v=2"
    odd.mkdir()
    (odd / "it's a recipe.py").write_text(ENTRY.format(section="my_section"))
    (odd / "my grpo.yaml").write_text("defaults: [grpo_tiny, _self_]\nentry: it's a recipe.py\n")
    cfg = load_config([f"recipe={odd / 'my grpo.yaml'}"])
    assert (cfg.name, cfg.entry) == ("my grpo", str(odd / "it's a recipe.py"))


def test_defaults_list_finds_yamls_beside_the_fork_and_a_fork_may_shadow_a_shipped_name(
    tmp_path: Path,
) -> None:
    (tmp_path / "my_base.yaml").write_text("rollout:\n  n: 3\n")
    fork_files(tmp_path, "")
    # Named like the shipped recipe, and starting from it: the file given is the one loaded.
    (tmp_path / "grpo_tiny.yaml").write_text(
        "defaults: [grpo_tiny, my_base, _self_]\nentry: my_recipe.py\noptim:\n  lr: 0.25\n"
    )
    cfg = load_config([f"recipe={tmp_path / 'grpo_tiny.yaml'}"])
    assert (cfg.optim.lr, cfg.rollout.n, cfg.trainer.total_steps) == (0.25, 3, 40)
    # Nothing stays registered for the next load.
    assert load_config(["recipe=grpo_tiny"], import_entry_module=False).rollout.n == 8


def test_defaults_entry_that_names_no_recipe(tmp_path: Path) -> None:
    path = fork_files(tmp_path, "defaults: [grpo_tny, _self_]\nentry: my_recipe.py\n")
    with pytest.raises(ConfigError, match=r"names 'grpo_tny', which is neither.*Did you mean grpo_tiny"):
        load_config([f"recipe={path}"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config([f"recipe={tmp_path / 'nope.yaml'}"])


def test_entry_by_path_resolves_and_fails_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    path = fork_files(
        tmp_path / "conf", "defaults: [grpo_tiny, _self_]\nentry: ../code/rec.py\n", entry="../code/rec.py"
    )
    cfg = load_config([f"recipe={path}"])
    assert cfg.entry == str(tmp_path / "code" / "rec.py")
    assert callable(import_entry(cfg.entry).main)
    # On the command line a relative entry starts at the working directory.
    monkeypatch.chdir(tmp_path)
    assert load_config([f"recipe={path}", "entry=code/rec.py"]).entry == str(tmp_path / "code" / "rec.py")
    with pytest.raises(ConfigError, match=f"no such file '{tmp_path / 'conf' / 'missing.py'}'"):
        load_config([f"recipe={path}", f"entry={tmp_path / 'conf' / 'missing.py'}"])
    (tmp_path / "no_main.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'no_main.py'} has no main"):
        load_config([f"recipe={path}", "entry=no_main.py"])
    with pytest.raises(ConfigError, match="no recipe module spmdrl.recipes.grp "):
        load_config(["entry=grp"])


def test_recipe_section_is_validated_and_typed(tmp_path: Path) -> None:
    path = fork_files(tmp_path, FORK_YAML)
    cfg = load_config([f"recipe={path}", "my_section.mode=slow"])
    section_cls = import_entry(cfg.entry).MySection
    section = cfg.section(section_cls)
    assert isinstance(section, section_cls) and (section.my_coef, section.mode) == (0.2, "slow")
    assert load_config([f"recipe={path}", "my_section.my_coef=0.3"]).section(section_cls).my_coef == 0.3
    cases = [
        (
            "my_section.my_cof=0.3",
            r"unknown config key 'my_section.my_cof'. Did you mean 'my_section.my_coef'",
        ),
        ("my_section.my_coef=fast", r"could not be converted to Float\s+full_key: my_section.my_coef"),
        ("my_section.mode=medium", r"my_section.mode='medium' is not one of fast, slow"),
        (
            "algorithm.my_coef=0.1",
            r"unknown config key 'algorithm.my_coef'",
        ),  # a built-in section stays closed
        ("my_sectoin.my_coef=0.1", r"Did you mean 'my_section'"),
    ]
    for override, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_config([f"recipe={path}", override])
    # In the YAML too.
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent(FORK_YAML).replace("my_coef: 0.2", "my_cof: 0.2"))
    with pytest.raises(
        ConfigError, match=r"'my_section.my_cof'. Did you mean 'my_section.my_coef'.*bad.yaml"
    ):
        load_config([f"recipe={bad}"])


def test_a_section_name_is_taken_once() -> None:
    from dataclasses import dataclass

    @dataclass
    class Other:
        x: int = 0

    with pytest.raises(ValueError, match="built-in key"):
        config_module.register_config_section("optim")(Other)
    config_module.register_config_section("taken")(Other)
    config_module.register_config_section("taken")(Other)  # the same class again (a module imported twice)

    @dataclass
    class Another:
        x: int = 0

    with pytest.raises(ValueError, match="already registered"):
        config_module.register_config_section("taken")(Another)


def test_saved_config_loads_again_to_the_same_config(tmp_path: Path) -> None:
    """A run's config.yaml (spmdrl.runtime writes to_yaml(cfg)) holds the sections and the entry's absolute
    path, and loads again as a recipe, from anywhere, to the same Config."""
    cfg = load_config([f"recipe={fork_files(tmp_path, FORK_YAML)}", "my_section.my_coef=0.3"])
    saved = tmp_path / "run" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(to_yaml(cfg))
    assert yaml.safe_load(saved.read_text())["my_section"] == {"my_coef": 0.3, "mode": "fast"}
    assert load_config([f"recipe={saved}"]) == cfg


def test_a_policy_loss_registered_in_the_entry_is_accepted(tmp_path: Path) -> None:
    """The entry is imported before the config is validated: its @register_policy_loss names are known."""
    from spmdrl.algos.policy_losses import POLICY_LOSSES

    path = fork_files(tmp_path, "defaults: [grpo_tiny, _self_]\nentry: my_recipe.py\n")
    with pytest.raises(ConfigError, match="unknown policy loss"):
        load_config([f"recipe={path}", "algorithm.policy_loss=fork_test_loss"])
    (tmp_path / "my_recipe.py").write_text(
        ENTRY.format(section="my_section2")
        + textwrap.dedent(
            """
            from spmdrl.algos.policy_losses import register_policy_loss, vanilla_policy_loss

            @register_policy_loss("fork_test_loss")
            def fork_test_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, is_weights_BT=None):
                return vanilla_policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, agg=agg,
                                           params=params, is_weights_BT=is_weights_BT)
            """
        )
    )
    # import_file caches modules by path: a new path for the edited file.
    path2 = tmp_path / "fork2"
    path2.mkdir()
    shutil.copy(tmp_path / "my_recipe.py", path2 / "my_recipe.py")
    shutil.copy(path, path2 / "my_grpo.yaml")
    try:
        cfg = load_config([f"recipe={path2 / 'my_grpo.yaml'}", "algorithm.policy_loss=fork_test_loss"])
        assert cfg.algorithm.policy_loss == "fork_test_loss"
    finally:
        if "fork_test_loss" in POLICY_LOSSES:
            POLICY_LOSSES.unregister("fork_test_loss")


@pytest.mark.parametrize(
    ("recipe", "differs"),
    [
        ("dapo_tiny", {"name", "reward", "algorithm"}),
        ("ppo_tiny", {"name", "entry", "critic", "algorithm"}),
        ("grpo_moe_tiny", {"name", "model"}),
    ],
)
def test_shipped_recipes_start_from_grpo_tiny(recipe: str, differs: set[str]) -> None:
    """dapo_tiny.yaml, ppo_tiny.yaml and grpo_moe_tiny.yaml hold only their differences (defaults:
    [grpo_tiny, _self_])."""
    import dataclasses

    text = (REPO / "configs" / "recipe" / f"{recipe}.yaml").read_text()
    assert "defaults:\n  - grpo_tiny\n  - _self_\n" in text and "warmstart:" not in text
    base = dataclasses.asdict(load_config(["recipe=grpo_tiny"], import_entry_module=False))
    cfg = dataclasses.asdict(load_config([f"recipe={recipe}"], import_entry_module=False))
    assert {key for key in base if base[key] != cfg[key]} == differs


def test_a_shipped_recipes_entry_is_composed_once_a_files_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The untyped pass that finds ``entry`` is kept for a shipped recipe (its YAMLs do not change while
    the process runs), never for a recipe file: an edited file's entry is read again."""
    from spmdrl import config_loader

    composed: list[list[str]] = []
    compose = config_loader._compose
    monkeypatch.setattr(
        config_loader, "_compose", lambda ov, schema: composed.append(ov) or compose(ov, schema)
    )
    for _ in range(2):
        load_config(["recipe=sft_tiny"], import_entry_module=False)
    probes = [ov for ov in composed if not any(o.startswith("entry=") for o in ov)]
    assert len(probes) <= 1 and len(composed) - len(probes) == 2  # the typed pass runs every time

    (tmp_path / "a.py").write_text(ENTRY.format(section="section_a"))
    (tmp_path / "b.py").write_text(ENTRY.format(section="section_b"))
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults: [grpo_tiny, _self_]\nentry: a.py\n")
    assert load_config([f"recipe={recipe}"], import_entry_module=False).entry == str(tmp_path / "a.py")
    recipe.write_text("defaults: [grpo_tiny, _self_]\nentry: b.py\n")
    assert load_config([f"recipe={recipe}"], import_entry_module=False).entry == str(tmp_path / "b.py")
