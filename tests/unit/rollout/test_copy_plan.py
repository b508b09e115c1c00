"""spmdrl.rollout.copy_plan: the first load's copies recorded, replayed as batched copies on new tensors,
and the loader kept for whatever the plan cannot replay.

The model and its loader are stand-ins written here with the shapes of vLLM's (a merged qkv parameter
whose loader narrows it per shard, a padded embedding whose loader zeroes the padding, a loader that
scales its tensor first): the recording does not depend on vLLM, and tests/integration/
test_weight_load_direct.py runs it on the real engine.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from spmdrl.rollout.copy_plan import CopyPlan


class _Engine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(6, 4))  # q: rows 0-3, k: 4, v: 5
        self.embed = nn.Parameter(torch.full((5, 4), 9.0))  # 3 real rows + 2 padding
        self.norm = nn.Parameter(torch.zeros(4))
        self.scaled = nn.Parameter(torch.zeros(4))
        self.loader_calls: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        rows = {"q": (0, 4), "k": (4, 1), "v": (5, 1)}
        with torch.no_grad():
            for name, t in weights:
                self.loader_calls.append(name)
                if name in rows:
                    start, n = rows[name]
                    self.qkv.data.narrow(0, start, n).copy_(t)
                elif name == "embed":
                    self.embed[: t.shape[0]].data.copy_(t)
                    self.embed[t.shape[0] :].data.fill_(0)
                elif name == "norm":
                    self.norm.data.copy_(t[1])  # row 1 of a (2, 4) tensor: a view with an offset
                elif name == "scaled":
                    self.scaled.data.copy_(t * 2)  # not a view of t


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # Cut from one flat buffer, as the sync's buckets are.
    flat = torch.randn(4 * 4 + 4 + 4 + 3 * 4 + 2 * 4 + 4, generator=g)
    sizes = {"q": (4, 4), "k": (1, 4), "v": (1, 4), "embed": (3, 4), "norm": (2, 4), "scaled": (4,)}
    out, off = [], 0
    for name, shape in sizes.items():
        n = torch.Size(shape).numel()
        out.append((name, flat[off : off + n].view(shape)))
        off += n
    return out


def _by_loader(seed: int) -> dict[str, torch.Tensor]:
    ref = _Engine()
    ref.load_weights(_weights(seed))
    return {k: v.detach().clone() for k, v in ref.named_parameters()}


def test_replay_writes_what_the_loaders_write_and_keeps_them_where_needed() -> None:
    model = _Engine()
    plan = CopyPlan.record(model, _weights(0), model.load_weights)
    assert {n for n, e in plan.entries.items() if e.replayable} == {"q", "k", "v", "norm"}
    assert "fill_" in plan.entries["embed"].why and "outside" in plan.entries["scaled"].why
    for seed in (1, 2):  # two more syncs, new tensors in new buffers
        model.loader_calls.clear()
        through_loader = plan.load(_weights(seed), model.load_weights)
        assert model.loader_calls == ["embed", "scaled"] and through_loader == 2
        want = _by_loader(seed)
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name]), name


def test_a_tensor_in_another_layout_takes_the_loader() -> None:
    model = _Engine()
    plan = CopyPlan.record(model, _weights(0), model.load_weights)
    weights = dict(_weights(3))
    weights["q"] = weights["q"].t().contiguous().t()  # the same values, column-major
    model.loader_calls.clear()
    plan.load(list(weights.items()), model.load_weights)
    assert model.loader_calls == ["q", "embed", "scaled"]
    assert torch.equal(model.qkv[:4], weights["q"])


def test_nothing_outside_the_loader_is_recorded() -> None:
    """The tensors are produced (here: scaled in place, a write to no parameter) while the recorder is
    off; only what the loader does to the parameters counts."""
    model = _Engine()

    def produced() -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in _weights(0):
            t = t.clone()
            t.mul_(1.0)  # the trainer's side: an in-place op on its own tensor
            model.norm.data.add_(0.0)  # even one on a parameter, outside the loader's call
            yield name, t

    plan = CopyPlan.record(model, produced(), model.load_weights)
    assert plan.entries["q"].replayable and plan.entries["norm"].replayable


def test_a_copy_from_a_neighbouring_tensor_keeps_the_loader() -> None:
    """A source in the same buffer but outside the tensor pulled (another tensor of the bucket) is not a
    view of that tensor: its name keeps the loader."""
    model = _Engine()
    weights = _weights(0)

    def load(items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            if name == "norm":  # reads the 4 elements before its own: the end of embed
                with torch.no_grad():
                    model.norm.data.copy_(t.as_strided((4,), (1,), t.storage_offset() - 4))
            else:
                model.load_weights([(name, t)])

    plan = CopyPlan.record(model, weights, load)
    assert not plan.entries["norm"].replayable and plan.entries["q"].replayable
