"""Advantage estimators: pure functions over reward tensors, one per verl ``algorithm.adv_estimator`` name.

Each estimator takes one :class:`AdvantageInputs` and returns ``(advantages_BT, returns_BT)``, both
float32 of shape (B, T) and 0 wherever ``response_mask_BT`` is 0, and is registered under its name by
the decorator above it, which also declares the inputs it needs beyond the rewards::

    @register_adv_estimator("my_estimator", needs_critic=False, needs_baseline=False,
                            needs_sum_pi_squared=False)
    def my_estimator(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]: ...

``needs_critic``: ``values_BT`` (the recipe builds and trains a critic); ``needs_baseline``:
``baseline_B`` (the recipe rolls each prompt out greedily once more); ``needs_sum_pi_squared``:
``old_logprobs_BT`` and ``sum_pi_squared_BT`` (the old-logprob pass computes both).
``algorithm.adv_estimator`` is a registered name or an estimator given by import path
(``my_pkg.adv:my_estimator``, ``path/to/adv.py:my_estimator``); :func:`adv_estimator` looks it up,
:func:`compute_advantages` checks that the inputs it declared are there and calls it.

The semantics follow verl's ``verl/trainer/ppo/core_algos.py`` (``compute_*_advantage*``), edge cases
included: a group of one sample gets mean 0 and std 1, so its advantage is its own reward (there is no
baseline to subtract); a sequence's score is the sum of its rewards over the whole row, so a token the
rollout correction rejected (it only edits the response mask, before the advantages, as in verl) keeps
its reward in the group's statistics. One difference, invisible to the loss: verl leaves some masked
positions non-zero (GAE's whitened advantages, the returns of REINFORCE++ and ReMax), spmdrl zeros them.

Group means and stds are over the samples of each group id in the rows passed in: a rank holds whole
groups. Whitening (GAE, REINFORCE++, REINFORCE++-baseline) and GPG's scale are over the whole batch:
when the rows are one rank's shard of it, ``AdvantageInputs.batch_sum`` sums the statistics' parts over
the ranks (spmdrl.distributed.reduce.sum_over_group), so every rank gets the whole batch's numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spmdrl.registry import Registered, Registry

# verl's masked_whiten adds this to the variance before the rsqrt (verl/utils/torch_functional.py);
# it is separate from the GRPO std epsilon ``AdvantageInputs.eps``.
WHITEN_EPS = 1e-8
# The optimal token baseline's denominator epsilon (verl's default for both OTB estimators).
OTB_EPS = 1e-8


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
    # Sums a tensor over every shard of the batch (an all_reduce over the actor's ranks), for the
    # batch-wide statistics; None: these rows are the whole batch. Every shard must call the estimator.
    batch_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    # optimal_token_baseline, tir_optimal_token_baseline: the old policy's logprobs (B, T), the sum over
    # the vocabulary of its squared probabilities at each step (B, T), and the rollout-correction
    # weights (B, T) when there are any.
    old_logprobs_BT: torch.Tensor | None = None
    sum_pi_squared_BT: torch.Tensor | None = None
    is_weights_BT: torch.Tensor | None = None
    # gdpo: (B, K) the K reward components of each sample (algorithm.gdpo_reward_keys) and their
    # weights (algorithm.gdpo_reward_weights; None: all 1).
    reward_components_BK: torch.Tensor | None = None
    reward_weights_K: tuple[float, ...] | None = None
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
        for name in ("old_logprobs_BT", "sum_pi_squared_BT", "is_weights_BT"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape_BT:
                raise ValueError(f"{name} must have shape {shape_BT}, got {tuple(t.shape)}")
        c = self.reward_components_BK
        if c is not None and (c.dim() != 2 or c.shape[0] != shape_BT[0]):
            raise ValueError(f"reward_components_BK must have shape ({shape_BT[0]}, K), got {tuple(c.shape)}")


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AdvEstimator(Registered):
    """A registered advantage estimator and the inputs it declares it needs (see the module docstring)."""

    needs_critic: bool = False
    needs_baseline: bool = False
    needs_sum_pi_squared: bool = False


ADV_ESTIMATORS: Registry[AdvEstimator] = Registry(
    "advantage estimator", AdvEstimator, decorator="register_adv_estimator", args=("inputs",)
)


def register_adv_estimator(
    name: str, *, needs_critic: bool = False, needs_baseline: bool = False, needs_sum_pi_squared: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Registers the decorated estimator as ``algorithm.adv_estimator=name``, with the inputs it needs."""
    return ADV_ESTIMATORS.register(
        name,
        needs_critic=needs_critic,
        needs_baseline=needs_baseline,
        needs_sum_pi_squared=needs_sum_pi_squared,
    )


def adv_estimator(name: str) -> AdvEstimator:
    """The estimator ``name`` (``algorithm.adv_estimator``: a registered name or an import path) and what
    it declared."""
    return ADV_ESTIMATORS.get(name)


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
    """Each sequence's scalar outcome: its rewards summed over the whole row, as verl does.

    Not over the valid tokens only: the rollout correction's rejection masks tokens (the last one, which
    holds the reward, or whole sequences) before the advantages, and verl still counts their rewards in
    the group statistics. Padding holds no reward (token_level_rewards, apply_kl_penalty leave it 0).
    """
    return inputs.token_rewards_BT.float().sum(dim=1)


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


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _masked_whiten(
    values_BT: torch.Tensor,
    valid_BT: torch.Tensor,
    batch_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """verl's ``masked_whiten``: ``(x - mean) / sqrt(var + 1e-8)`` with the mean and the unbiased
    variance (``sum (x - mean)^2 / (n - 1)``, verl's ``masked_var`` with its Bessel factor n / (n - 1))
    over the valid entries of the whole batch (``batch_sum`` adds the other shards'); 0 where not valid.
    """
    total = batch_sum or _identity
    x_BT = torch.where(valid_BT, values_BT, 0.0)
    # float64 for the reduced parts: a float32 token count is exact only up to 2^24.
    sum_n = total(torch.stack([x_BT.sum().double(), valid_BT.sum().double()]))
    n = int(sum_n[1])
    if n < 2:
        # As verl's masked_var: the unbiased variance of fewer than two numbers is undefined.
        raise ValueError(f"whitening needs at least 2 valid tokens in the batch, got {n}")
    mean = (sum_n[0] / n).to(values_BT.dtype)
    # Two passes (a second sum of squared deviations) rather than E[x^2] - E[x]^2, which cancels.
    centered_BT = torch.where(valid_BT, values_BT - mean, 0.0)
    var = (total((centered_BT * centered_BT).sum().double()) / (n - 1)).to(values_BT.dtype)
    return centered_BT * torch.rsqrt(var + WHITEN_EPS)


def _broadcast(advantages_B: torch.Tensor, valid_BT: torch.Tensor) -> torch.Tensor:
    """One scalar per sequence on each of its valid tokens, 0 elsewhere."""
    return torch.where(valid_BT, advantages_B.unsqueeze(1), 0.0)


# ---------------------------------------------------------------------------------------------- estimators


@register_adv_estimator("gae", needs_critic=True)
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
    return _masked_whiten(gae_BT, valid_BT, inputs.batch_sum), returns_BT


@register_adv_estimator("grpo")
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


@register_adv_estimator("grpo_vectorized")
def grpo_vectorized_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``grpo_vectorized``: ``grpo`` always divided by the group's std (verl's vectorized form computes the
    same numbers, and verl 0.9.1's trainer never hands it norm_adv_by_std_in_grpo; the config refuses
    ``norm_adv_by_std=false`` with it rather than ignore it)."""
    return grpo_outcome_advantages(dataclasses.replace(inputs, norm_by_std=True))


@register_adv_estimator("rloo")
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


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``reinforce_plus_plus``: REINFORCE++ (Hu, arXiv:2501.03262), no critic and no groups.

    ``G_t = r_t + gamma G_{t'}`` over a sequence's valid tokens t < t' (masked positions inside a
    response, e.g. tool output, are skipped: the return is carried through them unchanged and their
    rewards are ignored, as verl 0.9.1 does); returns = ``G``; advantages = ``G`` whitened over all valid
    tokens of the batch (mean and unbiased std).
    """
    valid_BT = inputs.response_mask_BT.bool()
    rewards_BT = inputs.token_rewards_BT.float()
    B, T = rewards_BT.shape
    running_B = rewards_BT.new_zeros(B)
    returns_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(T)):
        valid_B = valid_BT[:, t]
        running_B = torch.where(valid_B, rewards_BT[:, t] + inputs.gamma * running_B, running_B)
        returns_BT[:, t] = torch.where(valid_B, running_B, 0.0)
    return _masked_whiten(returns_BT, valid_BT, inputs.batch_sum), returns_BT


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``reinforce_plus_plus_baseline``: REINFORCE++ with the group mean as baseline (arXiv:2501.03262).

    ``A_i = r_i - mean_g`` (a group of one: mean 0), broadcast to the valid tokens, then whitened over
    all valid tokens of the batch, so a long sequence weighs more in the mean and std. Returns = advantages.
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    mean_B, _, _ = _group_stats(scores_B, inputs.group_ids_B)
    advantages_BT = _masked_whiten(_broadcast(scores_B - mean_B, valid_BT), valid_BT, inputs.batch_sum)
    return advantages_BT, advantages_BT


@register_adv_estimator("remax", needs_baseline=True)
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


@register_adv_estimator("opo")
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


@register_adv_estimator("grpo_passk")
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


@register_adv_estimator("gpg")
@torch.no_grad()
def gpg_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``gpg``: Group Policy Gradient (Chu et al., arXiv:2504.02546).

    ``A_i = alpha (r_i - mean_g)`` with ``alpha = B / max(#{i : r_i != 0}, 1)`` over the whole batch
    (it rescales the gradient that the zero-reward samples dilute) and no std division; a group of one
    has mean 0. (verl's ``f_norm`` is fixed at 1.) Returns = advantages.
    """
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    # B and the non-zero count of the whole batch: summed over the shards when the batch is sharded.
    counts = torch.stack([torch.tensor(scores_B.numel()), torch.count_nonzero(scores_B).cpu()])
    size, nonzero = (inputs.batch_sum or _identity)(counts.double().to(scores_B.device)).tolist()
    alpha = size / max(nonzero, 1.0)
    mean_B, _, _ = _group_stats(scores_B, inputs.group_ids_B)
    advantages_BT = _broadcast(alpha * (scores_B - mean_B), valid_BT)
    return advantages_BT, advantages_BT


@register_adv_estimator("rloo_vectorized")
@torch.no_grad()
def rloo_vectorized_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``rloo_vectorized``: RLOO as ``rloo`` (arXiv:2402.14740) for groups of n > 1,
    ``A_i = (n r_i - sum_g r) / (n - 1)``; a group of one gets 0, not its raw reward (verl's vectorized
    form masks it, ``* (n > 1)``; its loop form ``rloo`` keeps the reward)."""
    valid_BT = inputs.response_mask_BT.bool()
    scores_B = _scores_B(inputs)
    mean_B, _, count_B = _group_stats(scores_B, inputs.group_ids_B)
    loo_B = count_B / (count_B - 1).clamp_min(1) * (scores_B - mean_B)
    advantages_BT = _broadcast(torch.where(count_B > 1, loo_B, 0.0), valid_BT)
    return advantages_BT, advantages_BT


@register_adv_estimator("gdpo")
@torch.no_grad()
def gdpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdpo``: Group reward-Decoupled normalization Policy Optimization (arXiv:2601.05242; verl
    ``compute_gdpo_outcome_advantage``).

    Each reward component k (``reward_components_BK``: the reward function's ``gdpo_reward_keys``) is
    normalized within its group on its own, so that a dominant reward cannot drown the others, then::

        A_k = (r_k - mean_g(r_k)) / (std_g(r_k) + eps)        (GRPO per component; always divided by
                                                               the std, as verl's trainer runs it)
        A   = whiten(sum_k w_k A_k)                            (w = reward_weights_K, default 1s)

    with ``whiten`` over all valid tokens of the batch (``batch_sum`` sums the other shards' parts), as
    verl's ``masked_whiten``. Without components the single component is the sequence's score (verl's
    fallback to ``token_level_rewards``). Returns = advantages.
    """
    valid_BT = inputs.response_mask_BT.bool()
    if inputs.reward_components_BK is None:
        components_BK = _scores_B(inputs).unsqueeze(1)
    else:
        components_BK = inputs.reward_components_BK.to(valid_BT.device).float()
    K = components_BK.shape[1]
    weights_K = inputs.reward_weights_K if inputs.reward_weights_K is not None else (1.0,) * K
    if len(weights_K) != K:
        raise ValueError(f"gdpo: {len(weights_K)} reward weights for {K} reward components")
    total_B = components_BK.new_zeros(components_BK.shape[0])
    for k in range(K):
        mean_B, std_B, _ = _group_stats(components_BK[:, k], inputs.group_ids_B)
        # Always divided by the std: verl's trainer never hands gdpo norm_adv_by_std_in_grpo.
        normalized_B = (components_BK[:, k] - mean_B) / (std_B + inputs.eps)
        total_B = total_B + weights_K[k] * normalized_B
    advantages_BT = _masked_whiten(_broadcast(total_B, valid_BT), valid_BT, inputs.batch_sum)
    return advantages_BT, advantages_BT


def _zero_tail(
    baseline_BT: torch.Tensor, lengths_B: torch.Tensor, start_B: torch.Tensor, rows: torch.Tensor
) -> None:
    """verl's ``handle_zero_tail``: the part of a group's single longest trajectory past the
    second-longest one's length gets baseline 0 (no other sample reached those steps to estimate it)."""
    lengths = lengths_B[rows]
    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_max = torch.nonzero(lengths == longest).flatten()
    if at_max.numel() == 1 and longest > second:
        row = int(rows[at_max[0]])
        baseline_BT[row, int(start_B[row]) + second :] = 0.0


def _optimal_token_baseline(
    inputs: AdvantageInputs, *, multi_turn: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both OTB estimators; ``multi_turn`` compacts each row's valid tokens first (verl's TIR variant)."""
    if inputs.old_logprobs_BT is None or inputs.sum_pi_squared_BT is None:
        raise ValueError("optimal_token_baseline needs old_logprobs_BT and sum_pi_squared_BT")
    valid_BT = inputs.response_mask_BT.bool()
    B, T = valid_BT.shape
    rewards_BT = torch.where(valid_BT, inputs.token_rewards_BT.float(), 0.0)
    # Reward-to-go G_t and the path-variance weights, 0 outside the valid tokens.
    returns_BT = torch.where(valid_BT, rewards_BT.flip(1).cumsum(1).flip(1), 0.0)
    w_BT = 1.0 - 2.0 * torch.exp(inputs.old_logprobs_BT.float()) + inputs.sum_pi_squared_BT.float()
    if inputs.is_weights_BT is not None:
        w_BT = w_BT * inputs.is_weights_BT.float().square()  # minimizes the MSE under truncated IS
    cum_w_BT = torch.where(valid_BT, w_BT, 0.0).cumsum(1)
    lengths_B = valid_BT.sum(1)
    token_returns_BT = returns_BT
    if multi_turn:
        # Step j of a row is its j-th valid token: tool output between turns takes no step.
        order_BT = torch.argsort((~valid_BT).to(torch.int8), dim=1, stable=True)
        steps_BT = torch.arange(T, device=valid_BT.device).expand(B, T) < lengths_B.unsqueeze(1)
        returns_BT = torch.where(steps_BT, returns_BT.gather(1, order_BT), 0.0)
        cum_w_BT = torch.where(steps_BT, cum_w_BT.gather(1, order_BT), 0.0)
        start_B = torch.zeros_like(lengths_B)
    else:
        # Step t is column t: a group's samples share a prompt, so their responses start at one column.
        steps_BT = valid_BT
        cum_w_BT = torch.where(valid_BT, cum_w_BT, 0.0)
        start_B = torch.where(valid_BT.any(1), valid_BT.to(torch.int8).argmax(1), 0)
    # The TIR variant leaves empty rows out of their group; the other counts them (they add 0).
    member_B = lengths_B > 0 if multi_turn else torch.ones_like(lengths_B, dtype=torch.bool)
    group_ids_B = inputs.group_ids_B.to(valid_BT.device)
    ids_B = torch.where(member_B, group_ids_B, int(group_ids_B.min()) - 1)
    _, inverse_B, count_G = torch.unique(ids_B, return_inverse=True, return_counts=True)
    G = count_G.numel()
    num_GT = returns_BT.new_zeros(G, T).index_add_(0, inverse_B, returns_BT * cum_w_BT)
    den_GT = returns_BT.new_zeros(G, T).index_add_(0, inverse_B, cum_w_BT)
    # B*_t = sum_i G_it W_it / (sum_i W_it + eps) over the group's samples at step t.
    baseline_BT = (num_GT / (den_GT + OTB_EPS))[inverse_B]
    single_B = (count_G == 1)[inverse_B] | ~member_B
    baseline_BT = torch.where(single_B.unsqueeze(1), 0.0, baseline_BT)
    for g in torch.nonzero(count_G > 1).flatten().tolist():
        rows = torch.nonzero((inverse_B == g) & member_B).flatten()
        if rows.numel() > 1:
            _zero_tail(baseline_BT, lengths_B, start_B, rows)
    advantages_BT = torch.where(steps_BT, returns_BT - baseline_BT, 0.0)
    if multi_turn:  # back to the valid tokens' own columns (the steps past a row's length hold 0)
        advantages_BT = torch.zeros_like(advantages_BT).scatter_(1, order_BT, advantages_BT)
    return advantages_BT, token_returns_BT


@register_adv_estimator("optimal_token_baseline", needs_sum_pi_squared=True)
@torch.no_grad()
def optimal_token_baseline_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``optimal_token_baseline``: a baseline per time step, weighted by path variance (verl
    ``compute_optimal_token_baseline_advantage``; the variance-minimizing baseline of Greensmith et al.
    2004, per token as in "The Optimal Token Baseline", verl PR #3966).

    With ``G_t = sum_{s >= t} r_s`` (reward-to-go), ``pi_t = exp(old_logprob_t)`` and ``sum pi^2`` over the
    vocabulary at step t (``sum_pi_squared_BT``), the squared score norm ``||s_t||^2 = 1 - 2 pi_t +
    sum pi^2`` is accumulated along the path, ``W_t = sum_{j <= t} ||s_j||^2`` (times ``rho_j^2`` with
    rollout-correction weights ``is_weights_BT``), and per group and step::

        B*_t = sum_i G_it W_it / (sum_i W_it + 1e-8),        A_t = G_t - B*_t

    over the group's samples still running at t. A group of one has B* = 0; the single longest sample's
    steps past the second-longest one's length get B* = 0 too (verl's ``handle_zero_tail``). Step t is
    column t: a group's samples share a prompt, so their responses start at one column. Returns = G.
    """
    return _optimal_token_baseline(inputs, multi_turn=False)


@register_adv_estimator("tir_optimal_token_baseline", needs_sum_pi_squared=True)
@torch.no_grad()
def tir_optimal_token_baseline_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``tir_optimal_token_baseline``: ``optimal_token_baseline`` for multi-turn (tool-integrated)
    responses (verl ``compute_multi_turn_optimal_token_baseline_advantage``): step j of a sample is its
    j-th *valid* token, so the tool output between turns, masked, takes no step, and the baseline of
    step j compares the samples' j-th generated tokens. Empty samples are left out of their group."""
    return _optimal_token_baseline(inputs, multi_turn=True)


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator ``name`` (``algorithm.adv_estimator``) on ``inputs``, after checking that they
    hold what it declared it needs."""
    estimator = adv_estimator(name)
    if estimator.needs_critic and inputs.values_BT is None:
        raise ValueError(
            f"advantage estimator {name!r} needs a critic (values_BT): use recipe=ppo_tiny / a PPO recipe, "
            "or a critic-free estimator such as grpo"
        )
    if estimator.needs_baseline and inputs.baseline_B is None:
        raise ValueError(
            f"advantage estimator {name!r} needs baseline_B, the reward of a greedy rollout of each "
            "sample's prompt"
        )
    if estimator.needs_sum_pi_squared and (
        inputs.old_logprobs_BT is None or inputs.sum_pi_squared_BT is None
    ):
        raise ValueError(
            f"advantage estimator {name!r} needs old_logprobs_BT and sum_pi_squared_BT (the old policy's "
            "sum over the vocabulary of its squared probabilities at each step)"
        )
    return estimator.fn(inputs)
