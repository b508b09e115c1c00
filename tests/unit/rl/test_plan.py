"""The RL job's plan (spmdrl/rl/plan.py): a pure function of the config, the world size and the data's
size, which build_job builds from and ``--check --world-size N`` prints without a process group or model."""

from __future__ import annotations

import pytest

from spmdrl.config_loader import load_config
from spmdrl.errors import ConfigError
from spmdrl.rl.plan import Roles, plan_job
from spmdrl.train import parse_config


def test_grpo_colocated_plan_puts_every_role_on_every_rank() -> None:
    cfg = load_config(["recipe=grpo_tiny"])
    plan = plan_job(cfg, 8, 4000)
    assert plan.placement.kind == "colocated" and not plan.with_critic
    assert plan.derived.per_rank_batch_size == cfg.trainer.global_batch_size // 8
    assert plan.derived.total_steps == cfg.trainer.total_steps
    assert plan.describe(cfg)["placement"] == plan.placement.describe()


def test_ppo_split_plan_gives_the_critic_its_own_ranks_and_arithmetic() -> None:
    cfg = load_config(["recipe=ppo_tiny", "parallel.placement=split"])
    plan = plan_job(cfg, 4, 4000, Roles(critic=True))
    assert plan.placement.is_split and plan.placement.role("critic").ranks == [2, 3]
    assert plan.rl_critic is not None and plan.rl_critic.train_ranks == 2 and plan.rl.train_ranks == 2
    assert "critic_per_rank_mini_batch_seqs" in plan.describe(cfg)


def test_async_plan_recomputes_old_logprobs_when_generation_runs_ahead() -> None:
    cfg = load_config(["recipe=grpo_async_tiny", "trainer.max_staleness=1"])
    plan = plan_job(cfg, 3, 4000, Roles(asynchronous=True))
    assert plan.placement.is_async and plan.recompute_old and plan.scorer == "rollout"


def test_a_teacher_on_its_own_ranks_leaves_the_actor_the_rest_and_every_rank_generating() -> None:
    cfg = load_config(["recipe=opd_tiny", "parallel.teacher_ranks=1", "trainer.global_batch_size=24"])
    plan = plan_job(cfg, 4, 4000)
    assert plan.placement.teacher_apart and plan.placement.role("teacher").ranks == [3]
    assert plan.rl.train_ranks == 3 and plan.rl.per_rank_mini_batch_seqs == 24 * cfg.rollout.n // 3
    assert plan.derived.per_rank_batch_size == 24 // 4  # the prompts are still generated on all 4 ranks
    assert plan.describe(cfg)["teacher"] == "teacher: rank 3 (FSDP 1)"


@pytest.mark.parametrize(
    ("overrides", "expect"),
    [
        (
            ["parallel.teacher_ranks=1"],
            r"global_batch_size=32 prompts do not split .* actor's 3 ranks .*multiple of 12",
        ),
        (
            ["parallel.teacher_ranks=1", "trainer.global_batch_size=24", "algorithm.ppo_mini_batch_size=4"],
            r"ppo_mini_batch_size=4 prompts do not split evenly over the actor's 3 ranks",
        ),
        (["parallel.teacher_ranks=4"], r"parallel.teacher_ranks=4 does not fit the world of 4 ranks"),
    ],
)
def test_a_teacher_on_its_own_ranks_the_batch_does_not_fit_fails_in_the_plan(
    overrides: list, expect: str
) -> None:
    cfg = load_config(["recipe=opd_tiny", *overrides])
    with pytest.raises(ConfigError, match=expect):
        plan_job(cfg, 4, 4000)


def test_check_prints_where_the_teacher_and_the_actor_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=opd_tiny", "parallel.teacher_ranks=2", "--check", "--world-size", "4"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "actor: ranks 0-1 (FSDP 2)" in out and "teacher: ranks 2-3 (FSDP 2, no actor)" in out, out
    assert "the teacher on ranks of its own (ranks 2-3)" in out and "the actor's update on 2 ranks" in out, (
        out
    )


def test_a_world_the_batch_does_not_split_over_fails_in_the_plan() -> None:
    cfg = load_config(["recipe=grpo_tiny"])
    with pytest.raises(ConfigError, match="not divisible by the data-parallel size 7"):
        plan_job(cfg, 7, 4000)


def test_check_with_a_world_size_prints_the_recipes_plan(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=ppo_tiny", "parallel.placement=split", "--check", "--world-size", "4"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "plan on 4 ranks: split:" in out and "critic: ranks 2-3" in out
    assert "the critic's update on 2 ranks" in out


@pytest.mark.parametrize(
    ("args", "placement", "experts"),
    [
        (
            ["entry=grpo_async", "parallel.placement=async", "parallel.rollout_ranks=2"],
            "plan on 4 ranks: async: actor: ranks 0-1 (FSDP 2, experts EP 2 x FSDP 1)",
            "ranks 0-1 each split every MoE layer's experts, tokens sent to them by all-to-all; each expert "
            "FSDP2-sharded over the 1 rank(s) holding it; every engine gets every expert at each sync (ranks "
            "2-3's by broadcast from rank 0)",
        ),
        (
            [],
            "plan on 4 ranks: colocated: actor: ranks 0-3 (FSDP 4, experts EP 2 x FSDP 2)",
            "ranks 0-1, 2-3 each split every MoE layer's experts, tokens sent to them by all-to-all; each "
            "expert FSDP2-sharded over the 2 rank(s) holding it; every engine gets every expert at each sync",
        ),
    ],
)
def test_check_with_a_world_size_prints_the_expert_parallel_layout(
    capsys: pytest.CaptureFixture[str], args: list[str], placement: str, experts: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_moe_tiny", "parallel.ep=2", *args, "--check", "--world-size", "4"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert placement in out and f"expert parallelism (parallel.ep=2): {experts}\n" in out, out


def test_world_size_without_check_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_tiny", "--world-size", "2"])
    assert exit_info.value.code == 2
    assert "--world-size goes with --check" in capsys.readouterr().err


def test_check_refuses_a_world_the_job_does_not_fit_without_saying_ok(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_tiny", "parallel.placement=async", "--check", "--world-size", "4"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert (
        "config ok" not in captured.out
        and "parallel.placement=async needs the asynchronous loop" in captured.err
    )


def test_cfg_job_with_a_world_size_appends_the_plan_as_yaml_comments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import yaml

    with pytest.raises(SystemExit) as exit_info:
        parse_config(["recipe=grpo_tiny", "--cfg", "job", "--world-size", "2"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "# plan on 2 ranks: colocated:" in out
    assert yaml.safe_load(out)["trainer"]["global_batch_size"] == 32  # still the config, as YAML
