"""On-policy distillation's math (spmdrl/algos/distill.py) and the teacher section's checks
(spmdrl/algos/config.py TeacherConfig), on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.algos.config import TeacherConfig
from spmdrl.algos.distill import distill_advantages, distill_estimate, mix_advantages, reverse_kl_sums
from spmdrl.config import Config, ConfigError, validate

ON = TeacherConfig(path="tiny-teacher")


def test_advantage_is_the_teacher_minus_the_student_on_sampled_tokens():
    # Token 0: the teacher likes it more than the student (log 0.9 vs log 0.3): pushed up. Token 1: less
    # (log 0.1 vs log 0.6): pushed down. Token 2 is a prompt token: no advantage.
    student = torch.tensor([[math.log(0.3), math.log(0.6), -0.5]])
    teacher = torch.tensor([[math.log(0.9), math.log(0.1), -3.0]])
    mask = torch.tensor([[True, True, False]])
    adv = distill_advantages(ON, student, teacher, mask)
    assert adv[0, 0].item() == pytest.approx(math.log(3.0))
    assert adv[0, 1].item() == pytest.approx(-math.log(6.0))
    assert adv[0, 2].item() == 0.0
    assert adv[0, 0] > 0 > adv[0, 1]


def test_clamps_bound_an_impossible_token():
    # The teacher gives the token probability e^-50: its log-prob is clamped to -10, the estimate to 10.
    student = torch.tensor([[0.0, -0.1]])
    teacher = torch.tensor([[-50.0, -0.1]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = distill_advantages(ON, student, teacher, mask)
    assert adv[0, 0].item() == pytest.approx(-10.0)
    assert adv[0, 1].item() == pytest.approx(0.0)
    unclamped = TeacherConfig(path="t", loss_max_clamp=None, log_prob_min_clamp=None)
    assert distill_advantages(unclamped, student, teacher, mask)[0, 0].item() == pytest.approx(-50.0)
    tight = TeacherConfig(path="t", loss_max_clamp=2.0, log_prob_min_clamp=None)
    assert distill_advantages(tight, student, teacher, mask)[0, 0].item() == pytest.approx(-2.0)


def test_mixing_with_the_task_reward_weights_the_distillation():
    task = torch.tensor([[1.0, 1.0]])
    distill = torch.tensor([[0.5, -0.5]])
    alone = TeacherConfig(path="t", distillation_loss_coef=3.0)  # use_task_rewards=false: coef unused
    assert torch.equal(mix_advantages(alone, task, distill), distill)
    mixed = TeacherConfig(path="t", use_task_rewards=True, distillation_loss_coef=0.5)
    assert torch.allclose(mix_advantages(mixed, task, distill), torch.tensor([[1.25, 0.75]]))


def test_loss_mode_k3_gradient_moves_the_student_towards_the_teacher():
    # As a loss (use_policy_gradient=false) the k3 estimate's gradient pulls the student's log-prob up
    # where the teacher's is higher, down where it is lower; k1's would be the same constant for both.
    cfg = TeacherConfig(path="t", loss_mode="k3", use_policy_gradient=False)
    student = torch.tensor([[math.log(0.3), math.log(0.6)]], requires_grad=True)
    teacher = torch.tensor([[math.log(0.9), math.log(0.1)]])
    distill_estimate(cfg, student, teacher).sum().backward()
    assert student.grad is not None
    assert student.grad[0, 0] < 0 < student.grad[0, 1]  # descent raises token 0, lowers token 1


def test_reverse_kl_metric_is_the_mean_over_response_tokens():
    student = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, 0.0, 0.0]])
    teacher = torch.tensor([[-2.0, -2.5, -1.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    total, count = reverse_kl_sums(student, teacher, mask)
    assert count.item() == 3
    assert (total / count).item() == pytest.approx((1.0 + 0.5 - 0.25) / 3)


@pytest.mark.parametrize(
    ("overrides", "expect"),
    [
        ({"loss_mode": "k1", "use_policy_gradient": False}, "does not depend on the teacher"),
        ({"distillation_loss_coef": 0.0}, "distillation_loss_coef must be > 0"),
        ({"loss_max_clamp": -1.0}, "loss_max_clamp must be > 0"),
        ({"log_prob_min_clamp": 1.0}, "log_prob_min_clamp must be < 0"),
    ],
)
def test_bad_teacher_settings_are_refused(overrides: dict, expect: str):
    with pytest.raises(ConfigError, match=expect):
        TeacherConfig(path="tiny-teacher", **overrides).check()


def test_distillation_settings_without_a_teacher_are_refused():
    TeacherConfig().check()  # path "": distillation is off
    with pytest.raises(
        ConfigError, match=r"teacher.use_task_rewards, teacher.distillation_loss_coef set, but"
    ):
        TeacherConfig(use_task_rewards=True, distillation_loss_coef=0.5).check()


def test_other_placements_and_unknown_estimators_are_refused():
    cfg = Config(entry="grpo")
    cfg.teacher.path = "tiny-teacher"
    cfg.parallel.placement = "split"
    with pytest.raises(ConfigError, match="parallel.placement=colocated"):
        validate(cfg)
    cfg.teacher.loss_mode = "no_such_estimator"
    cfg.parallel.placement = "colocated"
    with pytest.raises(ConfigError, match="teacher.loss_mode"):
        validate(cfg)


@pytest.mark.parametrize(
    ("changes", "expect"),
    [
        (
            {"model.lora.rank": 8},
            r"parallel.teacher_ranks=1 \(the teacher on ranks of its own\) with model.lora",
        ),
        (
            {"reward_model.enable": True, "reward_model.path": "rm_dir"},
            r"parallel.teacher_ranks=1 .* with reward_model.enable",
        ),
        ({"parallel.placement": "async"}, r"needs parallel.placement=colocated"),
    ],
)
def test_what_a_teacher_on_ranks_of_its_own_does_not_run_is_refused_at_load(changes: dict, expect: str):
    cfg = Config(entry="grpo")
    cfg.teacher.path = "tiny-teacher"
    cfg.parallel.teacher_ranks = 1
    for key, value in changes.items():
        *parents, name = key.split(".")
        target = cfg
        for p in parents:
            target = getattr(target, p)
        setattr(target, name, value)
    with pytest.raises(ConfigError, match=expect) as e:
        validate(cfg)
    assert "parallel.teacher_ranks=0" in str(e.value) or "colocated" in str(e.value)
    cfg.parallel.teacher_ranks = 0  # the teacher on the actor's ranks: the same settings pass, but async
    if cfg.parallel.placement == "colocated":
        validate(cfg)
