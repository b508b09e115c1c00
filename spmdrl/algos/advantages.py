"""Advantage estimators: pure functions over reward tensors, one per verl ``algorithm.adv_estimator`` name.

Each estimator takes one :class:`AdvantageInputs` and returns ``(advantages_BT, returns_BT)``, both
float32 of shape (B, T) and 0 wherever ``response_mask_BT`` is 0. :data:`ADV_ESTIMATORS` maps verl's
name to the function; :func:`compute_advantages` checks the inputs a name needs and calls it.

The semantics follow verl's ``verl/trainer/ppo/core_algos.py`` (``compute_*_advantage*``), edge cases
included: a group of one sample gets mean 0 and std 1, so its advantage is its own reward (there is no
baseline to subtract). Two differences, both invisible to the loss: verl leaves some masked positions
non-zero (GAE's whitened advantages, the returns of REINFORCE++ and ReMax), spmdrl zeros them; and a
sequence's score is the sum of its rewards over its *valid* tokens (verl sums the whole row, whose
masked positions its reward and KL code already leaves at 0).

Statistics are over the tensors passed in: group means and stds over the samples of each group id,
whitening (GAE, REINFORCE++) and GPG's scale over the whole batch. Call an estimator on the batch verl
would see (every group whole; for the batch-wide ones, the whole step's batch) to get verl's numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# verl's masked_whiten adds this to the variance before the rsqrt (verl/utils/torch_functional.py);
# it is separate from the GRPO std epsilon ``AdvantageInputs.eps``.
WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads. Shapes: B sequences, T response positions."""

    # Float (B, T): each sequence's reward at its last valid response token, plus any per-token terms
    # (a KL penalty folded into the reward). Build the outcome part with token_level_rewards().
    token_rewards_BT: torch.Tensor
    # Bool or 0/1 (B, T): the sampled response tokens.
    response_mask_BT: torch.Tensor
    # Long (B,): samples of one prompt share an id; groups need not be consecutive or equal-sized.
    group_ids_B: torch.Tensor
    # Critic values (B, T), gae only.
    values_BT: torch.Tensor | None = None
    # (B,) the reward of the greedy rollout of each sample's prompt, remax only.
    baseline_B: torch.Tensor | None = None
    gamma: float = 1.0  # algorithm.gamma: discount (gae, reinforce_plus_plus)
    lam: float = 1.0  # algorithm.lam: GAE's lambda
    norm_by_std: bool = True  # algorithm.norm_adv_by_std (verl: norm_adv_by_std_in_grpo)
    eps: float = 1e-6  # added to a group's std before dividing by it

    def __post_init__(self) -> None:
        if self.token_rewards_BT.dim() != 2:
            raise ValueError(
                f"token_rewards_BT must be (B, T), got shape {tuple(self.token_rewards_BT.shape)}"
            )
        shape_BT = tuple(self.token_rewards_BT.shape)
        if tuple(self.response_mask_BT.shape) != shape_BT:
            raise ValueError(
                f"response_mask_BT {tuple(self.response_mask_BT.shape)} and token_rewards_BT {shape_BT} differ"
            )
        if tuple(self.group_ids_B.shape) != shape_BT[:1]:
            raise ValueError(
                f"group_ids_B must have shape ({shape_BT[0]},), got {tuple(self.group_ids_B.shape)}"
            )
        if self.group_ids_B.is_floating_point():
            raise ValueError("group_ids_B must be an integer tensor (one id per prompt)")
        if self.values_BT is not None and tuple(self.values_BT.shape) != shape_BT:
            raise ValueError(f"values_BT must have shape {shape_BT}, got {tuple(self.values_BT.shape)}")
        if self.baseline_B is not None and tuple(self.baseline_B.shape) != shape_BT[:1]:
            raise ValueError(
                f"baseline_B must have shape ({shape_BT[0]},), got {tuple(self.baseline_B.shape)}"
            )


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]


def token_level_rewards(scores_B: torch.Tensor, response_mask_BT: torch.Tensor) -> torch.Tensor:
    """Float32 (B, T): each row's score at its last valid response token, 0 elsewhere.

    This is where verl's reward managers put an outcome reward. A row with no valid token gets none.
    """
    if scores_B.dim() != 1 or scores_B.shape[0] != response_mask_BT.shape[0]:
        raise ValueError(
            f"scores_B must have shape ({response_mask_BT.shape[0]},), got {tuple(scores_B.shape)}"
        )
    valid_BT = response_mask_BT.bool()
    T = valid_BT.shape[1]
    positions_T = torch.arange(T, device=valid_BT.device)
    # Valid positions are distinct, so the largest masked position index is the last valid token.
    last_B = torch.where(valid_BT, positions_T, -1).amax(dim=1).clamp_min(0)
    score_B = torch.where(valid_BT.any(dim=1), scores_B.float(), 0.0)
    rewards_BT = torch.zeros(valid_BT.shape, dtype=torch.float32, device=valid_BT.device)
    return rewards_BT.scatter_(1, last_B.unsqueeze(1), score_B.unsqueeze(1))


# ---------------------------------------------------------------------------------------------- helpers


def _scores_B(inputs: AdvantageInputs) -> torch.Tensor:
    """Each sequence's scalar outcome: its rewards summed over its valid tokens."""
    valid_BT = inputs.response_mask_BT.bool()
    return torch.where(valid_BT, inputs.token_rewards_BT.float(), 0.0).sum(dim=1)


def _group_stats(
    scores_B: torch.Tensor, group_ids_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's (mean, unbiased std, size). A group of one gets mean 0 and std 1, as in
    verl, so that sample keeps its raw reward as advantage instead of an error or a 0/0."""
    _, inverse_B, count_G = torch.unique(
        group_ids_B.to(scores_B.device), return_inverse=True, return_counts=True
    )
    G = count_G.numel()
    count_G = count_G.to(scores_B.dtype)
    sum_G = torch.zeros(G, dtype=scores_B.dtype, device=scores_B.device).index_add_(0, inverse_B, scores_B)
    mean_G = sum_G / count_G
    # Two passes (deviations from the mean) rather than E[x^2] - E[x]^2, which cancels catastrophically.
    dev_B = scores_B - mean_G[inverse_B]
    sq_G = torch.zeros_like(sum_G).index_add_(0, inverse_B, dev_B * dev_B)
    std_G = (sq_G / (count_G - 1).clamp_min(1)).sqrt()  # Bessel's correction, torch.std's default
    single_G = count_G == 1
    mean_G = torch.where(single_G, 0.0, mean_G)
    std_G = torch.where(single_G, 1.0, std_G)
    return mean_G[inverse_B], std_G[inverse_B], count_G[inverse_B]


def _masked_whiten(values_BT: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten``: ``(x - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased
    variance over the valid entries of the whole batch; 0 where not valid."""
    n = int(valid_BT.sum())
    if n < 2:
        # As verl's masked_var: the unbiased variance of fewer than two numbers is undefined.
        raise ValueError(f"whitening needs at least 2 valid tokens in the batch, got {n}")
    x_BT = torch.where(valid_BT, values_BT, 0.0)
    mean = x_BT.sum() / n
    centered_BT = torch.where(valid_BT, values_BT - mean, 0.0)
    var = (centered_BT * centered_BT).sum() / (n - 1)
    return centered_BT * torch.rsqrt(var + WHITEN_EPS)


def _broadcast(advantages_B: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    """One scalar per sequence on each of its valid tokens, 0 elsewhere."""
    return torch.where(valid_BT, advantages_B.unsqueeze(1), 0.0)


# ---------------------------------------------------------------------------------------------- estimators


@torch.no_grad()
def gae_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``gae``: Generalized Advantage Estimation (Schulman et al. 2015), PPO with a critic.

    Over a sequence's valid tokens t < t' < ... (masked positions, e.g. tool output in a multi-turn
    response, are skipped as if absent; after the last one the next value is 0):
    ``delta_t = r_t + gamma V_t' - V_t``, ``A_t = delta_t + gamma lam A_t'``, ``returns_t = A_t + V_t``.
    The advantages (not the returns) are then whitened over all valid tokens of the batch, as verl does.
    """
    if inputs.values_BT is None:
        raise ValueError("gae needs critic values (values_BT)")
    valid_BT = inputs.response_mask_BT.bool()
    rewards_BT = inputs.token_rewards_BT.float()
    values_BT = inputs.values_BT.float()
    B, T = rewards_BT.shape
    gamma, lam = inputs.gamma, inputs.lam
    next_value_B = rewards_BT.new_zeros(B)
    next_gae_B = rewards_BT.new_zeros(B)
    gae_BT = torch.zeros_like(rewards_BT)
    # A reverse scan; torch.where (not arithmetic mixing by the mask) keeps NaN values at padding out.
    for t in reversed(range(T)):
        valid_B = valid_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        gae_B = delta_B + gamma * lam * next_gae_B
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        next_gae_B = torch.where(valid_B, gae_B, next_gae_B)
        gae_BT[:, t] = next_gae_B
    returns_BT = torch.where(valid_BT, gae_BT + values_BT, 0.0)
    return _masked_whiten(gae_BT, valid_BT), returns_BT


@torch.no_grad()
def grpo_outcome_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``grpo``: ``A_i = (r_i - mean_g) / (std_g + eps)``, or ``r_i - mean_g`` with ``norm_by_std=False``
    (Dr. GRPO, arXiv:2503.20783: dividing by the std up-weights nearly solved or hopeless prompts).

    ``mean_g``/``std_g``: mean and unbiased std of the scores of the sample's group; a group of one has
    mean 0, std 1. Broadcast to every valid token; returns = advantages.
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    mean_B, std_B, _ = _group_stats(scores_B, inputs.group_ids_B)
    advantages_B = scores_B - mean_B
    if inputs.norm_by_std:
        advantages_B = advantages_B / (std_B + inputs.eps)
    advantages_BT = _broadcast(advantages_B, valid_BT)
    return advantages_BT, advantages_BT


@torch.no_grad()
def rloo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``rloo``: REINFORCE leave-one-out (Ahmadian et al., arXiv:2402.14740).

    ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean_g)`` for a group of n > 1 samples; a
    group of one keeps its raw reward (verl's ``rloo``; its ``rloo_vectorized`` gives 0 there instead).
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    mean_B, _, count_B = _group_stats(scores_B, inputs.group_ids_B)
    loo_B = count_B / (count_B - 1).clamp_min(1) * (scores_B - mean_B)
    advantages_B = torch.where(count_B > 1, loo_B, scores_B)
    advantages_BT = _broadcast(advantages_B, valid_BT)
    return advantages_BT, advantages_BT


@torch.no_grad()
def reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``reinforce_plus_plus``: REINFORCE++ (Hu, arXiv:2501.03262), no critic and no groups.

    ``G_t = r_t + gamma G_{t+1}`` within each run of valid tokens (the sum restarts after a masked
    position, as verl's "reset after EOS"); returns = ``G``; advantages = ``G`` whitened over all valid
    tokens of the batch (mean and unbiased std).
    """
    valid_BT = inputs.response_mask_BT.bool()
    rewards_BT = inputs.token_rewards_BT.float()
    B, T = rewards_BT.shape
    running_B = rewards_BT.new_zeros(B)
    returns_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(T)):
        valid_B = valid_BT[:, t]
        running_B = torch.where(valid_B, rewards_BT[:, t] + inputs.gamma * running_B, 0.0)
        returns_BT[:, t] = running_B
    return _masked_whiten(returns_BT, valid_BT), returns_BT


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``reinforce_plus_plus_baseline``: REINFORCE++ with the group mean as baseline (arXiv:2501.03262).

    ``A_i = r_i - mean_g`` (a group of one: mean 0), broadcast to the valid tokens, then whitened over
    all valid tokens of the batch, so a long sequence weighs more in the mean and std. Returns = advantages.
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    mean_B, _, _ = _group_stats(scores_B, inputs.group_ids_B)
    advantages_BT = _masked_whiten(_broadcast(scores_B - mean_B, valid_BT), valid_BT)
    return advantages_BT, advantages_BT


@torch.no_grad()
def remax_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``remax``: ReMax (Li et al., arXiv:2310.10505): the greedy rollout's reward is the baseline.

    ``returns_t = sum_{s >= t} r_s`` over valid tokens (undiscounted; verl ignores gamma here),
    ``A_t = returns_t - b`` with ``b = baseline_B`` of the sample's prompt.
    """
    if inputs.baseline_B is None:
        raise ValueError("remax needs baseline_B: the reward of a greedy rollout of each sample's prompt")
    valid_BT = inputs.response_mask_BT.bool()
    rewards_BT = torch.where(valid_BT, inputs.token_rewards_BT.float(), 0.0)
    suffix_sum_BT = rewards_BT.flip(1).cumsum(1).flip(1)
    returns_BT = torch.where(valid_BT, suffix_sum_BT, 0.0)
    advantages_BT = torch.where(valid_BT, suffix_sum_BT - inputs.baseline_B.float().unsqueeze(1), 0.0)
    return advantages_BT, returns_BT


@torch.no_grad()
def opo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``opo``: On-Policy RL with the optimal baseline (Hao et al., arXiv:2505.23585).

    ``A_i = r_i - b_g`` with the length-weighted group baseline ``b_g = sum_j |o_j| r_j / sum_j |o_j|``
    (``|o_j|``: sample j's valid token count); a group of one has ``b_g = 0``. Returns = advantages.
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    lengths_B = valid_BT.sum(dim=1).float()
    _, inverse_B, count_G = torch.unique(inputs.group_ids_B, return_inverse=True, return_counts=True)
    G = count_G.numel()
    weighted_G = scores_B.new_zeros(G).index_add_(0, inverse_B, lengths_B * scores_B)
    length_G = scores_B.new_zeros(G).index_add_(0, inverse_B, lengths_B)
    # clamp: a group of empty responses has numerator 0 too, and no token to carry an advantage.
    baseline_G = torch.where(count_G > 1, weighted_G / length_G.clamp_min(1), 0.0)
    advantages_BT = _broadcast(scores_B - baseline_G[inverse_B], valid_BT)
    return advantages_BT, advantages_BT


@torch.no_grad()
def grpo_passk_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``grpo_passk``: Pass@k training (arXiv:2503.19595): only each group's best sample learns.

    The best sample of a group gets ``A = r_max - r_second`` (divided by ``std_g + eps`` when
    ``norm_by_std``); every other sample gets 0. Needs groups of at least 2 (verl raises too).
    On a tie for the best, ``A = 0`` whichever sample holds it.
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    _, inverse_B, count_G = torch.unique(inputs.group_ids_B, return_inverse=True, return_counts=True)
    if bool((count_G < 2).any()):
        raise ValueError(
            f"grpo_passk needs at least 2 samples per group, got a group of {int(count_G.min())}: "
            "raise the rollout n"
        )
    # Sort by score (descending), then stably by group: each group's samples become contiguous, best first.
    order_B = torch.argsort(scores_B, descending=True, stable=True)
    order_B = order_B[torch.argsort(inverse_B[order_B], stable=True)]
    start_G = torch.cumsum(count_G, 0) - count_G
    best_G, second_G = order_B[start_G], order_B[start_G + 1]
    gap_G = scores_B[best_G] - scores_B[second_G]
    if inputs.norm_by_std:
        _, std_B, _ = _group_stats(scores_B, inputs.group_ids_B)
        gap_G = gap_G / (std_B[best_G] + inputs.eps)
    advantages_B = torch.zeros_like(scores_B).index_put_((best_G,), gap_G)
    advantages_BT = _broadcast(advantages_B, valid_BT)
    return advantages_BT, advantages_BT


@torch.no_grad()
def gpg_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``gpg``: Group Policy Gradient (Chu et al., arXiv:2504.02546).

    ``A_i = alpha (r_i - mean_g)`` with ``alpha = B / max(#{i : r_i != 0}, 1)`` over the whole batch
    (it rescales the gradient that the zero-reward samples dilute) and no std division; a group of one
    has mean 0. (verl's ``f_norm`` is fixed at 1.) Returns = advantages.
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    alpha = scores_B.numel() / max(int(torch.count_nonzero(scores_B)), 1)
    mean_B, _, _ = _group_stats(scores_B, inputs.group_ids_B)
    advantages_BT = _broadcast(alpha * (scores_B - mean_B), valid_BT)
    return advantages_BT, advantages_BT


# verl's algorithm.adv_estimator name -> estimator.
ADV_ESTIMATORS: dict[str, AdvantageFn] = {
    "gae": gae_advantages,
    "grpo": grpo_outcome_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "remax": remax_advantages,
    "opo": opo_advantages,
    "grpo_passk": grpo_passk_advantages,
    "gpg": gpg_advantages,
}
NEEDS_CRITIC = frozenset({"gae"})
NEEDS_BASELINE = frozenset({"remax"})


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run verl's estimator ``name`` (``algorithm.adv_estimator``) on ``inputs``."""
    fn = ADV_ESTIMATORS.get(name)
    if fn is None:
        raise ValueError(f"unknown advantage estimator {name!r}; use one of {', '.join(ADV_ESTIMATORS)}")
    if name in NEEDS_CRITIC and inputs.values_BT is None:
        raise ValueError(
            f"advantage estimator {name!r} needs a critic (values_BT): use recipe=ppo_tiny / a PPO recipe, "
            "or a critic-free estimator such as grpo"
        )
    if name in NEEDS_BASELINE and inputs.baseline_B is None:
        raise ValueError(
            f"advantage estimator {name!r} needs baseline_B, the reward of a greedy rollout of each "
            "sample's prompt"
        )
    return fn(inputs)


def grpo_advantages(
    rewards_B: torch.Tensor, group_size: int, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's group-relative advantage of every sequence, as a float32 tensor of shape (B,).

    ``rewards_B`` holds consecutive groups of ``group_size`` samples of one prompt each; the advantage
    is that of :func:`grpo_outcome_advantages` (mean/unbiased std of the group; ``norm_by_std=False``
    is Dr. GRPO). A group whose rewards are all equal gets advantage 0: it carries no learning signal.
    ``group_size == 1`` follows verl (mean 0, std 1): each advantage is the raw reward / (1 + eps),
    i.e. REINFORCE without a baseline.
    """
    if rewards_B.dim() != 1:
        raise ValueError(
            f"rewards_B must be 1-D (one reward per sequence), got shape {tuple(rewards_B.shape)}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    B = rewards_B.numel()
    if B % group_size:
        raise ValueError(
            f"{B} rewards do not split into groups of {group_size}: each prompt's {group_size} samples "
            "must be consecutive and a rank must hold whole groups"
        )
    scores_B = rewards_B.float()
    group_ids_B = torch.arange(B, device=rewards_B.device) // group_size
    mean_B, std_B, _ = _group_stats(scores_B, group_ids_B)
    advantages_B = scores_B - mean_B
    if norm_by_std:
        advantages_B = advantages_B / (std_B + eps)
    return advantages_B
