"""A fork is files in any directory (issue 18's contract): a recipe YAML by path that starts from a shipped
recipe, an entry file beside it, the recipe's own config section, its own policy loss; --help and --cfg job.

The unit tests load configs in this process with small entry files (no model). The end-to-end test runs a
copy of recipes/grpo.py from a temporary directory for two GRPO steps under torchrun.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from spmdrl import config as config_module
from spmdrl.config import ConfigError
from spmdrl.config_loader import available_recipes, import_entry, load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]

# An entry file as small as a recipe can be: a section of its own and a main.
ENTRY = textwrap.dedent(
    """
    from dataclasses import dataclass

    from spmdrl.config import Config, choice, register_config_section


    @register_config_section("{section}")
    @dataclass
    class MySection:
        my_coef: float = 0.1
        mode: str = choice("fast", ("fast", "slow"))


    def main(cfg: Config) -> None:
        print("my_coef", cfg.section(MySection).my_coef)
    """
)


@pytest.fixture(autouse=True)
def _restore_sections() -> Iterator[None]:
    """Each test's entry files register sections; forget them afterwards (the registry is process-wide)."""
    saved = dict(config_module.CONFIG_SECTIONS)
    yield
    config_module.CONFIG_SECTIONS.clear()
    config_module.CONFIG_SECTIONS.update(saved)


def _fork(
    tmp_path: Path, yaml_text: str, *, section: str = "my_section", entry: str = "my_recipe.py"
) -> Path:
    (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / entry).write_text(ENTRY.format(section=section))
    path = tmp_path / "my_grpo.yaml"
    path.write_text(textwrap.dedent(yaml_text))
    return path


FORK_YAML = """\
    defaults: [grpo_tiny, _self_]
    entry: my_recipe.py
    optim:
      lr: 0.5
    my_section:
      my_coef: 0.2
    """


def test_recipe_yaml_by_path_starts_from_a_shipped_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _fork(tmp_path, FORK_YAML)
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
    _fork(tmp_path, "")
    # Named like the shipped recipe, and starting from it: the file given is the one loaded.
    (tmp_path / "grpo_tiny.yaml").write_text(
        "defaults: [grpo_tiny, my_base, _self_]\nentry: my_recipe.py\noptim:\n  lr: 0.25\n"
    )
    cfg = load_config([f"recipe={tmp_path / 'grpo_tiny.yaml'}"])
    assert (cfg.optim.lr, cfg.rollout.n, cfg.trainer.total_steps) == (0.25, 3, 40)
    # Nothing stays registered for the next load.
    assert load_config(["recipe=grpo_tiny"], import_entry_module=False).rollout.n == 8


def test_defaults_entry_that_names_no_recipe(tmp_path: Path) -> None:
    path = _fork(tmp_path, "defaults: [grpo_tny, _self_]\nentry: my_recipe.py\n")
    with pytest.raises(ConfigError, match=r"names 'grpo_tny', which is neither.*Did you mean grpo_tiny"):
        load_config([f"recipe={path}"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config([f"recipe={tmp_path / 'nope.yaml'}"])


def test_entry_by_path_resolves_and_fails_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    path = _fork(
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
    path = _fork(tmp_path, FORK_YAML)
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
    cfg = load_config([f"recipe={_fork(tmp_path, FORK_YAML)}", "my_section.my_coef=0.3"])
    saved = tmp_path / "run" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(to_yaml(cfg))
    assert yaml.safe_load(saved.read_text())["my_section"] == {"my_coef": 0.3, "mode": "fast"}
    assert load_config([f"recipe={saved}"]) == cfg


def test_a_policy_loss_registered_in_the_entry_is_accepted(tmp_path: Path) -> None:
    """The entry is imported before the config is validated: its @register_policy_loss names are known."""
    from spmdrl.algos.policy_losses import POLICY_LOSSES

    path = _fork(tmp_path, "defaults: [grpo_tiny, _self_]\nentry: my_recipe.py\n")
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
    [("dapo_tiny", {"name", "reward", "algorithm"}), ("ppo_tiny", {"name", "entry", "critic", "algorithm"})],
)
def test_shipped_recipes_start_from_grpo_tiny(recipe: str, differs: set[str]) -> None:
    """dapo_tiny.yaml and ppo_tiny.yaml hold only their differences (defaults: [grpo_tiny, _self_])."""
    import dataclasses

    text = (REPO / "configs" / "recipe" / f"{recipe}.yaml").read_text()
    assert "defaults:\n  - grpo_tiny\n  - _self_\n" in text and "warmstart:" not in text
    base = dataclasses.asdict(load_config(["recipe=grpo_tiny"], import_entry_module=False))
    cfg = dataclasses.asdict(load_config([f"recipe={recipe}"], import_entry_module=False))
    assert {key for key in base if base[key] != cfg[key]} == differs


# ---------------------------------------------------------------------------------------------- command line


def _train_cli(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "spmdrl.train", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_lists_the_recipes_without_importing_torch() -> None:
    # Without a CPU kind to emulate (--cpu-kind): emulating one patches torch's CPU queries at import.
    res = _train_cli("--help", env={"SPMDRL_CPU_KIND": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    for name in available_recipes():
        assert f"\n  {name} " in res.stdout
    assert "GRPO on the built-in tiny Qwen2" in res.stdout  # the YAML's first comment line
    assert "recipe=path/to/x.yaml" in res.stdout and "--cfg job" in res.stdout and "key=value" in res.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "vllm" not in imported


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    path = _fork(tmp_path, FORK_YAML)
    res = _train_cli(f"recipe={path}", "my_section.my_coef=0.4", "--cfg", "job", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    printed = yaml.safe_load(res.stdout)
    assert printed["optim"]["lr"] == 0.5 and printed["rollout"]["n"] == 8
    assert printed["my_section"] == {"my_coef": 0.4, "mode": "fast"}
    assert printed["entry"] == str(tmp_path / "my_recipe.py")


def test_config_errors_exit_2_naming_the_path(tmp_path: Path) -> None:
    path = _fork(tmp_path, "defaults: [grpo_tiny, _self_]\nentry: missing.py\n")
    res = _train_cli(f"recipe={path}", cwd=tmp_path)
    assert res.returncode == 2
    assert f"spmdrl: config error: entry='{tmp_path / 'missing.py'}': no such file" in res.stderr
    res = _train_cli("--cfg", "hydra", cwd=tmp_path)
    assert res.returncode == 2 and "--cfg job" in res.stderr


# ---------------------------------------------------------------------------------------------- end to end

# What a researcher adds to their copy of recipes/grpo.py: a setting of their own, in a section of their
# own, and a policy loss that reads it.
FORK_ADDITIONS = textwrap.dedent(
    """
    # ------------------------------------------------------------------------------------------ the fork
    import dataclasses as _dataclasses

    from spmdrl.algos.policy_losses import register_policy_loss, vanilla_policy_loss
    from spmdrl.config import register_config_section


    @register_config_section("my_grpo")
    @_dataclasses.dataclass
    class MyGrpoConfig:
        loss_scale: float = 1.0  # the fork's new hyperparameter: my_loss multiplies vanilla's loss by it


    @register_policy_loss("my_loss", section=MyGrpoConfig)
    def my_loss(
        logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, params, section, is_weights_BT=None
    ):
        out = vanilla_policy_loss(
            logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, agg=agg, params=params,
            is_weights_BT=is_weights_BT,
        )
        out.loss = out.loss * section.loss_scale
        out.metrics["my_loss_scale"] = torch.tensor(section.loss_scale)
        return out


    _grpo_main = main


    def main(cfg):
        print(f"my_grpo.loss_scale={cfg.section(MyGrpoConfig).loss_scale}", flush=True)
        _grpo_main(cfg)


    """
)

FORK_E2E_YAML = """\
# My GRPO: grpo_tiny with a loss of my own.
defaults: [grpo_tiny, _self_]
entry: my_grpo.py
my_grpo:
  loss_scale: 0.5
"""


def write_fork(fork: Path) -> None:
    """docs/forking.md's fork: my_grpo.yaml and my_grpo.py (recipes/grpo.py + FORK_ADDITIONS) in ``fork``."""
    source = (REPO / "recipes" / "grpo.py").read_text()
    head, sep, tail = source.partition('if __name__ == "__main__":')
    (fork / "my_grpo.py").write_text(head + FORK_ADDITIONS + sep + tail)
    (fork / "my_grpo.yaml").write_text(FORK_E2E_YAML)


@pytest.mark.slow
def test_fork_in_another_directory_runs_two_grpo_steps(tmp_path: Path) -> None:
    from spmdrl.logging.metrics import read_metrics
    from spmdrl.testing.launch import torchrun

    fork, work = tmp_path / "fork", tmp_path / "work"
    fork.mkdir()
    work.mkdir()
    write_fork(fork)
    out = tmp_path / "run"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=../fork/my_grpo.yaml",  # relative to the working directory
            "algorithm.policy_loss=my_loss",
            "my_grpo.loss_scale=0.25",
            f"trainer.output_dir={out}",
            "warmstart.enabled=false",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "trainer.save_hf=false",
            "tiny_task.num_train=64",
            "trainer.global_batch_size=4",
            "rollout.n=2",
            "trainer.micro_batch_size=8",
        ],
        nproc=2,
        cwd=work,
        timeout_s=900,
        env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
    )
    assert res.returncode == 0, res.output[-5000:]
    assert "my_grpo.loss_scale=0.25" in res.output
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(
        r["actor/my_loss_scale"] == pytest.approx(0.25) for r in rows
    )  # the loss ran, with the setting
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["my_grpo"] == {"loss_scale": 0.25} and saved["algorithm"]["policy_loss"] == "my_loss"
    assert saved["entry"] == str(fork / "my_grpo.py") and saved["name"] == "my_grpo"
