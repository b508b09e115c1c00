"""A fork is files in any directory (issue 18's contract), end to end: a copy of recipes/grpo.py runs from a
temporary directory for two GRPO steps under torchrun (tests/unit/test_config_loader.py loads forks)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from spmdrl import config as config_module

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_sections() -> Iterator[None]:
    """Each test's entry files register sections; forget them afterwards (the registry is process-wide)."""
    saved = dict(config_module.CONFIG_SECTIONS)
    yield
    config_module.CONFIG_SECTIONS.clear()
    config_module.CONFIG_SECTIONS.update(saved)


# ---------------------------------------------------------------------------------------------- end to end

# What a researcher adds to their copy of recipes/grpo.py: a setting of their own, in a section of their
# own, an advantage estimator and a policy loss that reads the setting. Nothing of spmdrl/rl/ is copied.
FORK_ADDITIONS = textwrap.dedent(
    """
    # ------------------------------------------------------------------------------------------ the fork
    import dataclasses as _dataclasses

    import torch

    from spmdrl.algos.advantages import AdvantageInputs, grpo_outcome_advantages, register_adv_estimator
    from spmdrl.algos.policy_losses import register_policy_loss, vanilla_policy_loss
    from spmdrl.config import register_config_section


    @register_config_section("my_grpo")
    @_dataclasses.dataclass
    class MyGrpoConfig:
        loss_scale: float = 1.0  # the fork's new hyperparameter: my_loss multiplies vanilla's loss by it


    @register_adv_estimator("my_adv")
    @torch.no_grad()
    def my_adv(inputs: AdvantageInputs):
        # GRPO's group advantage, only the better-than-average samples kept: a worse one is not pushed down.
        advantages_BT, _ = grpo_outcome_advantages(inputs)
        advantages_BT = advantages_BT.clamp(min=0.0)
        return advantages_BT, advantages_BT


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
        out.metrics["my_adv_min"] = advantages_BT[mask_BT.bool()].min() if mask_BT.any() else torch.tensor(0.0)
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


def test_the_forks_advantage_keeps_only_better_than_average_samples(tmp_path: Path) -> None:
    """docs/forking.md's estimator, from the fork file itself: a group's worse samples get 0, the better
    ones GRPO's advantage."""
    import torch

    from spmdrl.algos.advantages import ADV_ESTIMATORS, AdvantageInputs, compute_advantages
    from spmdrl.algos.policy_losses import POLICY_LOSSES
    from spmdrl.config_loader import import_entry

    write_fork(tmp_path)
    try:
        import_entry(str(tmp_path / "my_grpo.py"))  # as spmdrl.train imports an entry file
        mask_BT = torch.ones(4, 3, dtype=torch.bool)
        rewards_BT = torch.zeros(4, 3)
        rewards_BT[:, -1] = torch.tensor([1.0, 0.0, 0.0, 1.0])
        inputs = AdvantageInputs(rewards_BT, mask_BT, torch.tensor([0, 0, 1, 1]))
        ours, _ = compute_advantages("my_adv", inputs)
        grpo, _ = compute_advantages("grpo", inputs)
    finally:  # the registries are process-wide
        for registry, name in ((ADV_ESTIMATORS, "my_adv"), (POLICY_LOSSES, "my_loss")):
            if name in registry:
                registry.unregister(name)
    assert (grpo < 0).any()
    assert torch.equal(ours, grpo.clamp(min=0.0))


@pytest.mark.guarantee("fork:recipe")
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
            "algorithm.adv_estimator=my_adv",
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
    # The loss saw the fork's advantages: none below 0 (GRPO's own go below 0 in any group whose rewards differ).
    assert all(r["actor/my_adv_min"] >= 0.0 for r in rows)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["my_grpo"] == {"loss_scale": 0.25} and saved["algorithm"]["policy_loss"] == "my_loss"
    assert saved["algorithm"]["adv_estimator"] == "my_adv"
    assert saved["entry"] == str(fork / "my_grpo.py") and saved["name"] == "my_grpo"
