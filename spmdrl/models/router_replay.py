"""A mixture of experts' routers in the trainer: router replay (R3) and the routing's statistics.

Each MoE layer's router (transformers' ``mlp.gate``, Qwen3-MoE's ``Qwen3MoeTopKRouter``) returns
``(router_logits, top-k weights, top-k indices)``, and the layer's experts (``mlp.experts``) compute from
the last two. :class:`RouterTap` puts a forward hook on each router, so the seam is the router's output and
nothing of the experts' forward changes (expert parallelism replaces ``mlp.experts``, not this).

Router replay (``model.router_replay=r3``; "Rollout Routing Replay", arXiv 2510.23027, verl's
``router_replay.mode=R3``): the top-k *indices* are the ones the rollout engine chose for the token, while
the *weights* are the trainer's own: the softmax of the router's own logits, taken at the engine's
indices, renormalized over them when the model renormalizes (``norm_topk_prob``), exactly as transformers
computes its weights at its own indices. So the trainer's forward routes each token through the experts
the sampled token went through, and the router weights still get their gradient, through the gating
weights of those experts (and through an auxiliary loss when one is added). A token with no recorded
choice (marked -1: padding, the last token of a row, which the engine never ran through the model) keeps
the router's own top-k.

Statistics of each forward's real tokens (:class:`RouterStats`, summed on the device; read once per step):
the tokens each expert received per layer (the load balance), how many replayed tokens the router would
have sent elsewhere, and transformers' load-balancing loss (Switch Transformer's ``E * sum_e f_e P_e``
over every layer's tokens, as ``load_balancing_loss_func`` computes it), with its gradient, for
``model.router_aux_loss_coef``.

A decoder layer recomputed in backward (activation checkpointing) runs its router again: the replay stays
set until the next forward sets its own (the recomputation routes as the forward did), and each layer's
statistics are counted once per forward.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spmdrl.models.packing import Packed

NO_CHOICE = -1  # a token without a recorded choice: the router's own top-k
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
_WRAPPERS = re.compile(r"\.(?:_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(layer index, router)`` of every MoE layer of ``model`` (transformers' top-k routers: a module
    ``layers.<i>.mlp.gate`` with ``top_k`` and ``num_experts``), in layer order; empty for a dense model."""
    found = []
    for name, m in model.named_modules():
        # Wrappers add a level to the names: activation checkpointing's, torch.compile's.
        hit = _LAYER.search(_WRAPPERS.sub("", name))
        if hit and hasattr(m, "top_k") and hasattr(m, "num_experts"):
            found.append((int(hit.group(1)), m))
    return sorted(found, key=lambda x: x[0])


@dataclass
class RouterStats:
    """Sums over the tokens of the forwards since the last :meth:`RouterTap.take_stats`, on the device."""

    load_LE: torch.Tensor  # the tokens each expert received (counting each of a token's k choices)
    replayed: torch.Tensor  # (token, layer) pairs routed by the engine's choice (real tokens only)
    differs: torch.Tensor  # of those, the ones whose own top-k (as a set) is not the engine's
    aux_loss: torch.Tensor  # transformers' load-balancing loss, summed over forwards
    forwards: int = 0

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int, device: torch.device) -> RouterStats:
        """No forward counted yet (float64 on ``device``)."""
        z = torch.zeros((), dtype=torch.float64, device=device)
        load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        return cls(load, z.clone(), z.clone(), z.clone())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "load_LE": self.load_LE,
            "replayed": self.replayed,
            "differs": self.differs,
            "aux_loss": self.aux_loss,
            "forwards": torch.tensor(float(self.forwards), dtype=torch.float64, device=self.load_LE.device),
        }


def moe_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """``moe/*`` from :class:`RouterStats` sums (added over micro-batches and ranks): per layer the
    normalized entropy of the experts' token fractions (1: perfectly even, 0: one expert takes every
    token) and the largest fraction times the number of experts (1: even, E: one expert takes all);
    their means over layers; the share of replayed tokens whose own top-k differs; the auxiliary loss per
    forward."""
    load_LE = sums["load_LE"].double()
    L, E = load_LE.shape
    frac_LE = load_LE / load_LE.sum(dim=1, keepdim=True).clamp_min(1)
    ent_L = -(frac_LE * frac_LE.clamp_min(1e-30).log()).sum(dim=1) / math.log(E)
    max_L = frac_LE.max(dim=1).values * E
    out: dict[str, float] = {}
    for layer, (ent, mx) in enumerate(zip(ent_L.tolist(), max_L.tolist(), strict=True)):
        out[f"moe/load_entropy/layer_{layer}"] = ent
        out[f"moe/max_load/layer_{layer}"] = mx
    out["moe/load_entropy"] = float(ent_L.mean())
    out["moe/max_load"] = float(max_L.mean())
    forwards = float(sums["forwards"])
    if forwards > 0:
        out["moe/aux_loss"] = float(sums["aux_loss"]) / forwards
    replayed = float(sums["replayed"])
    if replayed > 0:
        out["moe/replay_differs"] = float(sums["differs"]) / replayed
    return out


@dataclass
class _Forward:
    """What one forward's routers read and add to (set by :meth:`RouterTap.forward`)."""

    replay_NLK: torch.Tensor | None  # the engine's choices in the forward's token order, or None
    valid_N: torch.Tensor | None  # the real tokens (statistics count only them); None: every token
    want_aux: bool
    counted: set[int] = field(default_factory=set)
    # transformers' loss sums over every layer's tokens: choices and probabilities per expert.
    choice_sum_E: torch.Tensor | None = None
    prob_sum_E: torch.Tensor | None = None
    tokens: torch.Tensor | None = None

    def aux_loss(self) -> torch.Tensor | None:
        if self.prob_sum_E is None or self.choice_sum_E is None or self.tokens is None:
            return None
        n = self.tokens.clamp_min(1)
        return (self.choice_sum_E / n * self.prob_sum_E / n).sum() * self.prob_sum_E.numel()


class RouterTap:
    """Forward hooks on a model's MoE routers (one tap per model: :func:`router_tap`)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("RouterTap: the model has no MoE router (layers.<i>.mlp.gate)")
        first = self.routers[0][1]
        self.num_layers = 1 + self.routers[-1][0]
        self.num_experts = int(first.num_experts)
        self.top_k = int(first.top_k)
        self._current: _Forward | None = None
        self._stats: RouterStats | None = None
        for layer, gate in self.routers:
            gate.register_forward_hook(self._hook(layer, gate))

    @contextmanager
    def forward(
        self,
        replay_NLK: torch.Tensor | None = None,
        valid_N: torch.Tensor | None = None,
        *,
        want_aux: bool = False,
    ) -> Iterator[_Forward]:
        """Around one model forward: route by ``replay_NLK`` (the engine's top-k indices per token in the
        order the model sees its tokens, (N, layers, k), NO_CHOICE where none) and count the statistics
        over ``valid_N``. The replay stays in place after the block (a checkpointed layer's recomputation
        in backward routes the same) until the next forward replaces it."""
        fwd = _Forward(replay_NLK, valid_N, want_aux)
        self._current = fwd
        yield fwd
        stats = self._stats_on(replay_NLK if replay_NLK is not None else valid_N)
        stats.forwards += 1
        aux = fwd.aux_loss()
        if aux is not None:
            stats.aux_loss += aux.detach().double()

    def take_stats(self) -> RouterStats | None:
        """The statistics since the last take (None if no forward ran), and a fresh start."""
        stats, self._stats = self._stats, None
        return stats

    def _stats_on(self, like: torch.Tensor | None) -> RouterStats:
        if self._stats is None:
            device = like.device if like is not None else self.routers[0][1].weight.device
            self._stats = RouterStats.zeros(self.num_layers, self.num_experts, device)
        return self._stats

    def _hook(self, layer: int, gate: nn.Module):  # noqa: ANN202
        norm = bool(getattr(gate, "norm_topk_prob", True))

        def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
            fwd = self._current
            if fwd is None:
                return None
            logits_NE, weights_NK, own_NK = output
            chosen_NK, weights = own_NK, weights_NK
            replay_NK = None
            if fwd.replay_NLK is not None:
                replay_NK = fwd.replay_NLK[:, layer].to(own_NK.device, torch.long)
                replayed_N = (replay_NK >= 0).all(dim=-1)
                chosen_NK = torch.where(replayed_N[:, None], replay_NK, own_NK)
                probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float)
                w_NK = probs_NE.gather(1, chosen_NK)
                if norm:
                    w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
                weights = w_NK.to(weights_NK.dtype)
            # Counted once per forward; computed at every call, so that a checkpointed layer's recomputation
            # saves for backward what its forward saved (the auxiliary loss's softmax).
            self._count(layer, fwd, logits_NE, own_NK, chosen_NK, replay_NK, first=layer not in fwd.counted)
            fwd.counted.add(layer)
            if replay_NK is None:
                return None
            return logits_NE, weights, chosen_NK

        return hook

    def _count(
        self,
        layer: int,
        fwd: _Forward,
        logits_NE: torch.Tensor,
        own_NK: torch.Tensor,
        chosen_NK: torch.Tensor,
        replay_NK: torch.Tensor | None,
        *,
        first: bool,
    ) -> None:
        valid_N = fwd.valid_N if fwd.valid_N is not None else torch.ones_like(own_NK[:, 0], dtype=torch.bool)
        valid_N = valid_N.to(own_NK.device)
        # transformers' load_balancing_loss_func: over every layer's (real) tokens, the fraction routed
        # to each expert (a token counted at each of its k choices) times its mean probability, times E.
        # The probabilities carry the router's gradient where the loss is trained on.
        with torch.set_grad_enabled(fwd.want_aux and torch.is_grad_enabled()):
            probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float)
            m = valid_N[:, None].to(probs_NE.dtype)
            prob_E = (probs_NE * m).sum(dim=0)
        if not first:
            return
        stats = self._stats_on(own_NK)
        with torch.no_grad():
            onehot_NE = torch.zeros_like(logits_NE, dtype=torch.float64).scatter_(1, chosen_NK, 1.0)
            load_E = (onehot_NE * valid_N[:, None]).sum(dim=0)  # also the loss's choices (whole counts)
            stats.load_LE[layer] += load_E
            if replay_NK is not None:
                replayed_N = (replay_NK >= 0).all(dim=-1) & valid_N
                same_N = (own_NK.sort(dim=-1).values == replay_NK.sort(dim=-1).values).all(dim=-1)
                stats.replayed += replayed_N.sum()
                stats.differs += (replayed_N & ~same_N).sum()
            choice_E = load_E.to(probs_NE.dtype)
            n = valid_N.sum().to(probs_NE.dtype)
        fwd.prob_sum_E = prob_E if fwd.prob_sum_E is None else fwd.prob_sum_E + prob_E
        fwd.choice_sum_E = choice_E if fwd.choice_sum_E is None else fwd.choice_sum_E + choice_E
        fwd.tokens = n if fwd.tokens is None else fwd.tokens + n


def router_tap(model: nn.Module) -> RouterTap | None:
    """The model's tap (made, and its hooks registered, on first use); None for a dense model."""
    tap = getattr(model, "_spmdrl_router_tap", None)
    if tap is None and routers(model):
        tap = RouterTap(model)
        model._spmdrl_router_tap = tap  # type: ignore[assignment]
    return tap


def replay_layout(
    routed_BTLK: torch.Tensor, packed: Packed | None, lengths_B: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine's choices of right-padded rows, (B, T, layers, k), in the order the model sees the
    tokens: flattened (B * T) rows, or the packed rows' (R * C) positions (NO_CHOICE at each row's tail).
    And the real tokens in that order (None when every padded position counts: no lengths)."""
    B, T, L, K = routed_BTLK.shape
    flat = routed_BTLK.reshape(B * T, L, K)
    valid = valid_tokens(packed, lengths_B, B, T, flat.device)
    if packed is None:
        return flat, valid
    R, C = packed.input_ids_RC.shape
    out = flat.new_full((R * C, L, K), NO_CHOICE)
    out[packed.packed_idx_N] = flat[packed.padded_idx_N]
    return out, valid


def valid_tokens(
    packed: Packed | None, lengths_B: list[int] | None, B: int, T: int, device: torch.device
) -> torch.Tensor | None:
    """The real tokens in the order the model sees them (None when every padded position counts: no
    lengths); :func:`replay_layout` lays the engine's choices out in the same order."""
    if packed is not None:
        R, C = packed.input_ids_RC.shape
        valid = torch.zeros(R * C, dtype=torch.bool, device=device)
        valid[packed.packed_idx_N] = True
        return valid
    if lengths_B is None:
        return None
    valid = torch.arange(T, device=device)[None, :] < torch.tensor(lengths_B, device=device)[:, None]
    return valid.reshape(-1)
