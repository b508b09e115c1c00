"""On-policy distillation's step of make-experience (spmdrl/rl/experience.py distill_experience): which
student logprobs it reads, the advantages it writes, the metric (one process)."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.algos.config import TeacherConfig
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.experience import distill_experience


def _batch(**fields: torch.Tensor) -> PolicyBatch:
    ids = torch.zeros(1, 4, dtype=torch.long)
    mask = torch.tensor([[False, True, True, False]])
    engine = torch.tensor([[0.0, math.log(0.2), math.log(0.8), 0.0]])
    teacher = torch.tensor([[-5.0, math.log(0.8), math.log(0.2), -5.0]])
    task = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    return PolicyBatch(ids, torch.ones_like(ids), mask, engine, task, teacher_logprobs_BT=teacher, **fields)


def test_the_engine_sampled_so_its_logprobs_are_the_students():
    out, metrics = distill_experience(TeacherConfig(path="t"), _batch())
    assert out.advantages_BT[0, 1].item() == pytest.approx(math.log(4.0))  # the teacher's favourite: up
    assert out.advantages_BT[0, 2].item() == pytest.approx(-math.log(4.0))  # the student's: down
    assert out.advantages_BT[0, 0].item() == 0.0 and out.advantages_BT[0, 3].item() == 0.0
    # (log .2 - log .8 + log .8 - log .2) / 2 tokens
    assert metrics == {"distill/reverse_kl": pytest.approx(0.0, abs=1e-6)}


def test_recomputed_old_logprobs_are_preferred_and_the_task_mixes_in():
    old = torch.tensor([[0.0, math.log(0.4), math.log(0.4), 0.0]])
    cfg = TeacherConfig(path="t", use_task_rewards=True, distillation_loss_coef=0.5)
    out, metrics = distill_experience(cfg, _batch(old_logprobs_BT=old))
    assert out.advantages_BT[0, 1].item() == pytest.approx(1.0 + 0.5 * math.log(2.0))
    assert out.advantages_BT[0, 2].item() == pytest.approx(1.0 - 0.5 * math.log(2.0))
    assert metrics["distill/reverse_kl"] == pytest.approx((math.log(0.5) + math.log(2.0)) / 2)


def test_as_a_loss_term_without_the_task_the_advantages_are_zero():
    cfg = TeacherConfig(path="t", loss_mode="k3", use_policy_gradient=False)
    out, _ = distill_experience(cfg, _batch())
    assert not out.advantages_BT.any()
