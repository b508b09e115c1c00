"""On-policy distillation's math (teacher.*, docs/algorithms.md#on-policy-distillation): pure functions over
the student's and the teacher's logprobs of the tokens the student sampled.

The student's samples make each token's ``log pi(a) - log pi_T(a)`` an unbiased estimate of the per-token
reverse KL, KL(pi || pi_T) (k1). Two ways to train on it, as verl's ``use_policy_gradient`` chooses:

- a dense per-token advantage ``A_t = -estimate_t`` (Thinking Machines' formulation): the policy loss
  (algorithm.policy_loss, PPO's clipped ratio against the old policy) is the importance-sampled policy
  gradient of the reverse KL, so tokens the teacher likes more than the student are pushed up;
- a loss term ``coef x agg(estimate_t)`` backpropagated through the student's logprobs (k3 or k2, whose
  gradients depend on the teacher; k1's does not).

Both clamp the logprobs from below (``log_prob_min_clamp``) and each token's estimate from above
(``loss_max_clamp``), so that one token the teacher finds impossible does not dominate a batch.
"""

from __future__ import annotations

import torch

from spmdrl.algos.config import TeacherConfig
from spmdrl.algos.kl import kl_penalty


def distill_estimate(
    teacher: TeacherConfig, student_logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor
) -> torch.Tensor:
    """Per-token teacher.loss_mode estimate of KL(student || teacher), (B, T), clamped as configured;
    gradients flow into the student's logprobs (the teacher's are a frozen model's)."""
    student_BT, teacher_BT = student_logprobs_BT, teacher_logprobs_BT.detach()
    if teacher.log_prob_min_clamp is not None:
        student_BT = student_BT.clamp(min=teacher.log_prob_min_clamp)
        teacher_BT = teacher_BT.clamp(min=teacher.log_prob_min_clamp)
    estimate_BT = kl_penalty(student_BT, teacher_BT, teacher.loss_mode)
    if teacher.loss_max_clamp is not None:
        estimate_BT = estimate_BT.clamp(max=teacher.loss_max_clamp)
    return estimate_BT


def distill_advantages(
    teacher: TeacherConfig,
    student_logprobs_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
) -> torch.Tensor:
    """The dense advantage ``-estimate`` on the response tokens (0 elsewhere), detached: a token the teacher
    gives more probability than the student gets a positive advantage."""
    estimate_BT = distill_estimate(teacher, student_logprobs_BT.detach(), teacher_logprobs_BT)
    return torch.where(response_mask_BT.bool(), -estimate_BT, torch.zeros_like(estimate_BT))


def mix_advantages(
    teacher: TeacherConfig, task_advantages_BT: torch.Tensor | None, distill_advantages_BT: torch.Tensor
) -> torch.Tensor:
    """teacher.use_task_rewards: the task's advantages plus distillation_loss_coef x the distillation's;
    otherwise the distillation's alone (``task_advantages_BT`` unused: None is fine)."""
    if not teacher.use_task_rewards:
        return distill_advantages_BT
    assert task_advantages_BT is not None, "use_task_rewards needs the task's advantages"
    return task_advantages_BT + teacher.coef * distill_advantages_BT


def reverse_kl_sums(
    student_logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor, response_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum of ``log pi - log pi_T`` over the response tokens, their count): the per-token reverse KL's
    k1 estimate is their ratio once summed over ranks (the metric distill/reverse_kl). Unclamped: the
    metric shows what the clamps hide."""
    mask_BT = response_mask_BT.bool()
    diff_BT = (student_logprobs_BT.detach() - teacher_logprobs_BT.detach()).double()
    return torch.where(mask_BT, diff_BT, torch.zeros_like(diff_BT)).sum(), mask_BT.sum().double()
