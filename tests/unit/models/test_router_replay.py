"""Router replay (R3) and the routing statistics on a small Qwen3-MoE (spmdrl.models.router_replay),
through policy_forward as the trainer's passes call it: padded and packed rows."""

from __future__ import annotations

import math

import pytest
import torch

from spmdrl.models.forward import policy_forward
from spmdrl.models.router_replay import NO_CHOICE, moe_metrics, router_tap, routers
from spmdrl.models.tiny import MOE_SHAPE

L, E, K = MOE_SHAPE["num_hidden_layers"], MOE_SHAPE["num_experts"], MOE_SHAPE["num_experts_per_tok"]


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=96, **MOE_SHAPE)
    model = Qwen3MoeForCausalLM(cfg).float()
    model.config.use_cache = False  # as spmdrl.models.build sets it: a scoring pass keeps no KV cache
    # Random experts and router (transformers initializes the experts' 3-D tensors, the router at 0).
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def _rows(B: int = 3, T: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (B, T), generator=g)
    lengths = [T, T - 4, T - 7]
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = 0
    return ids, mask, lengths


def _own_choices(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each token's top-k per layer under the model's own routing, (B, T, L, K)."""
    B, T = ids.shape
    got: dict[int, torch.Tensor] = {}
    hooks = [
        gate.register_forward_hook(lambda _m, _a, out, i=i: got.__setitem__(i, out[2].detach()))
        for i, gate in routers(model)
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return torch.stack([got[i].view(B, T, K) for i in range(L)], dim=2)


def _forward(model, ids, mask, lengths, routed=None, pack=False, grad=False):  # noqa: ANN001, ANN202
    with torch.set_grad_enabled(grad):
        return policy_forward(
            model,
            ids,
            mask,
            pack_sequences=pack,
            lengths_B=lengths,
            first_columns_B=[1] * len(lengths),
            routed_experts_BTLK=routed,
            router_aux_grad=grad,
        )


def _other_choices(own: torch.Tensor) -> torch.Tensor:
    """Another top-k for every token: the experts its own choice left out (E = 2K)."""
    all_E = torch.arange(E)
    flat = own.reshape(-1, K)
    rest = torch.stack([all_E[~torch.isin(all_E, r)] for r in flat])
    return rest.view(own.shape)


def test_replaying_the_models_own_choice_changes_nothing_and_differs_nowhere() -> None:
    model = _model()
    ids, mask, lengths = _rows()
    tap = router_tap(model)
    assert tap is not None and (tap.num_layers, tap.num_experts, tap.top_k) == (L, E, K)
    plain = _forward(model, ids, mask, lengths).logprobs_BT
    tap.take_stats()
    own = _own_choices(model, ids).to(torch.int16)
    replayed = _forward(model, ids, mask, lengths, routed=own).logprobs_BT
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)
    stats = tap.take_stats()
    assert stats is not None
    assert moe_metrics(stats.tensors())["moe/replay_differs"] == 0.0
    # Every real token (not the padding) counted once per layer, at each of its k choices.
    assert stats.load_LE.sum(dim=1).tolist() == [sum(lengths) * K] * L
    assert stats.replayed.item() == sum(lengths) * L  # (token, layer) pairs


def test_replayed_indices_route_the_experts_and_the_weights_are_the_routers_softmax_there() -> None:
    model = _model()
    ids, mask, lengths = _rows()
    tap = router_tap(model)
    assert tap is not None
    own = _own_choices(model, ids)
    other = _other_choices(own).to(torch.int16)
    # What the experts of layer 2 are handed, and the router's logits there.
    seen: dict[str, torch.Tensor] = {}
    experts = model.model.layers[2].mlp.experts
    gate = model.model.layers[2].mlp.gate
    h1 = experts.register_forward_pre_hook(lambda _m, args: seen.update(idx=args[1], w=args[2]))
    h2 = gate.register_forward_hook(lambda _m, _a, out: seen.update(logits=out[0].detach()), prepend=True)
    tap.take_stats()
    lp = _forward(model, ids, mask, lengths, routed=other).logprobs_BT
    h1.remove()
    h2.remove()
    B, T = ids.shape
    torch.testing.assert_close(seen["idx"].view(B, T, K), other[:, :, 2].long())
    probs = torch.softmax(seen["logits"].float(), dim=-1)
    want = probs.gather(1, other[:, :, 2].reshape(-1, K).long())
    want = want / want.sum(dim=-1, keepdim=True)  # norm_topk_prob
    torch.testing.assert_close(seen["w"].detach(), want)
    # Other experts: other logprobs, and every real token's choice differs from the router's own.
    plain = _forward(model, ids, mask, lengths).logprobs_BT
    assert (lp - plain).abs().max() > 1e-3
    stats = tap.take_stats()
    assert stats is not None
    first = moe_metrics({k: v for k, v in stats.tensors().items()})
    assert first["moe/replay_differs"] == 1.0


def test_the_router_gets_a_gradient_through_the_replayed_weights() -> None:
    model = _model()
    model.train()
    ids, mask, lengths = _rows()
    other = _other_choices(_own_choices(model, ids)).to(torch.int16)
    out = _forward(model, ids, mask, lengths, routed=other, grad=True)
    out.logprobs_BT.sum().backward()
    for _, gate in routers(model):
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_no_choice_tokens_keep_the_routers_own_top_k() -> None:
    model = _model()
    ids, mask, lengths = _rows()
    own = _own_choices(model, ids)
    mixed = _other_choices(own).to(torch.int16)
    mixed[:, 5:] = NO_CHOICE  # from column 5 on: no recorded choice
    plain = _forward(model, ids, mask, lengths).logprobs_BT
    lp = _forward(model, ids, mask, lengths, routed=mixed).logprobs_BT
    # Causal: a token's logprob depends on the routing of the tokens before it; column 1..5 predict from
    # replayed routing, so they differ; rows' later columns differ too (they attend to replayed ones).
    assert (lp[:, 1:6] - plain[:, 1:6]).abs().max() > 1e-3
    # A fully unrecorded row equals the plain forward.
    none = torch.full_like(mixed, NO_CHOICE)
    torch.testing.assert_close(
        _forward(model, ids, mask, lengths, routed=none).logprobs_BT, plain, rtol=0, atol=1e-6
    )


def test_packed_and_padded_replay_agree() -> None:
    model = _model()
    ids, mask, lengths = _rows()
    other = _other_choices(_own_choices(model, ids)).to(torch.int16)
    padded = _forward(model, ids, mask, lengths, routed=other).logprobs_BT
    packed = _forward(model, ids, mask, lengths, routed=other, pack=True).logprobs_BT
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_aux_loss_is_transformers_load_balancing_loss() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = _model()
    ids, mask, lengths = _rows()
    T = ids.shape[1]
    out = _forward(model, ids, mask, [T] * 3)  # every position counts, as transformers' call without a mask
    got = model(input_ids=ids, output_router_logits=True)
    want = load_balancing_loss_func(got.router_logits, E, K)
    assert out.router_aux_loss is not None
    torch.testing.assert_close(out.router_aux_loss.float(), want.float(), rtol=1e-5, atol=1e-6)


def test_moe_metrics_of_even_and_skewed_loads() -> None:
    even = torch.full((2, 4), 10.0, dtype=torch.float64)
    skew = torch.tensor([[40.0, 0, 0, 0], [20.0, 20.0, 0, 0]], dtype=torch.float64)
    z = torch.tensor(0.0, dtype=torch.float64)
    m = moe_metrics({"load_LE": even, "replayed": z, "differs": z, "aux_loss": z, "forwards": z})
    assert m["moe/load_entropy"] == pytest.approx(1.0) and m["moe/max_load"] == pytest.approx(1.0)
    assert "moe/replay_differs" not in m
    m = moe_metrics(
        {"load_LE": skew, "replayed": z + 8, "differs": z + 2, "aux_loss": z + 3, "forwards": z + 2}
    )
    assert m["moe/load_entropy/layer_0"] == pytest.approx(0.0)
    assert m["moe/load_entropy/layer_1"] == pytest.approx(math.log(2) / math.log(4))
    assert m["moe/max_load/layer_0"] == pytest.approx(4.0)
    assert m["moe/replay_differs"] == pytest.approx(0.25) and m["moe/aux_loss"] == pytest.approx(1.5)


def test_the_routers_are_found_through_the_checkpoint_wrappers() -> None:
    from spmdrl.models.parallelize import apply_ac

    for mode in ("full", "mlp"):  # layers.<i>._checkpoint_wrapped_module.mlp.gate, layers.<i>.mlp._checkp...
        model = _model()
        apply_ac(model, mode)
        assert [i for i, _ in routers(model)] == list(range(L)), mode


def test_a_checkpointed_layer_recomputes_with_the_replayed_routing() -> None:
    """Activation checkpointing runs each router again in backward: it must route as the forward did (the
    replay stays in place), or the gradients would be another routing's."""
    from spmdrl.models.parallelize import apply_ac

    ids, mask, lengths = _rows()
    grads = []
    for ac in (False, True):
        model = _model()
        model.train()
        other = _other_choices(_own_choices(model, ids)).to(torch.int16)
        if ac:
            apply_ac(model, "full")
        tap = router_tap(model)
        assert tap is not None and len(tap.routers) == L  # found through the checkpoint wrappers
        out = _forward(model, ids, mask, lengths, routed=other, grad=True)
        out.logprobs_BT.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
