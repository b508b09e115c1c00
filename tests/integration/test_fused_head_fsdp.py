"""The fused LM head under FSDP2 on 2 gloo ranks: the head weight is a sharded DTensor the root unit
all-gathers, tied to the embedding or not.

Each rank runs policy_forward on its own padded or packed rows through the real build path
(build_fsdp_model: per-layer units + root), plain and fused head, and backpropagates a loss on the
logprobs and the entropy. Asserted: the fused head's logprobs and entropy equal a single-process model's
(no FSDP, plain head) on the same rows; its gradients, reduced over the ranks (summed, as apply_fsdp
sets), equal the sum of the single-process gradients of both ranks' rows, the head weight included;
and the fused forward and backward read nothing from the device (spmdrl.testing.syncs.SyncCounter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.models import save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

CHUNK = 5  # positions per chunk: several chunks per micro-batch, the last one partial


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """A rank's right-padded rows, their lengths and first sampled columns (seeded by rank)."""
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(6, 20, (4,), generator=g).tolist()
    firsts = [int(torch.randint(1, n, (1,), generator=g)) for n in lengths]
    T = max(lengths)
    attn = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, 64, (4, T), generator=g) * attn
    return ids, attn, lengths, firsts


def _loss_and_grads(model: torch.nn.Module, rows: tuple[Any, ...], chunk: int, pack: bool) -> tuple[Any, ...]:
    from spmdrl.models.forward import policy_forward

    ids, attn, lengths, firsts = rows
    model.zero_grad(set_to_none=True)
    out = policy_forward(
        model,
        ids,
        attn,
        temperature=0.8,
        with_entropy=True,
        pack_sequences=pack,
        first_column=min(firsts),
        lengths_B=lengths,
        first_columns_B=firsts,
        fused_chunk_tokens=chunk,
    )
    assert out.entropy_BT is not None
    (out.logprobs_BT.sum() + 0.3 * out.entropy_BT.sum()).backward()
    return out.logprobs_BT.detach(), out.entropy_BT.detach()


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return out


def _worker(rank: int, world: int, model_dir: str, pack: bool) -> dict[str, Any]:
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.testing.syncs import SyncCounter

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    f32 = torch.float32
    model = build_fsdp_model(ModelSpec(Path(model_dir), f32, f32), mesh, torch.device("cpu"))
    # The head weight is a shard on each rank: only the root's all-gather makes it whole.
    assert hasattr(model.get_output_embeddings().weight, "full_tensor")
    results: dict[str, Any] = {}
    rows = _rows(rank)
    for chunk in (0, CHUNK):
        # Made before the counter, the rows count as device tensors (a GPU batch): only what
        # policy_forward and the backward read is counted.
        with SyncCounter() as c:
            lp, ent = _loss_and_grads(model, rows, chunk, pack)
        results[chunk] = (lp, ent, _full_grads(model), c.summary() if c.count() else "")
    return results


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fused_fsdp") / "m"
    save_small_qwen2(path, tie_word_embeddings=request.param)
    return path


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_fused_head_under_fsdp2(model_dir: Path, pack: bool) -> None:
    from transformers import AutoModelForCausalLM

    ranks = run_distributed(_worker, 2, str(model_dir), pack)
    # The reference: one process, no FSDP, the plain head, each rank's rows in turn.
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_grads: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        lp, ent = _loss_and_grads(ref_model, _rows(rank), 0, pack)
        for name, g in _full_grads(ref_model).items():
            ref_grads[name] = ref_grads.get(name, 0) + g
        for chunk in (0, CHUNK):
            got_lp, got_ent, _, syncs = result[chunk]
            torch.testing.assert_close(got_lp, lp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_ent, ent, rtol=1e-5, atol=1e-6)
            assert not syncs, f"rank {rank}, chunk {chunk}: {syncs}"
    head = "lm_head.weight" if "lm_head.weight" in ref_grads else "model.embed_tokens.weight"
    assert ref_grads[head].abs().sum() > 0
    for chunk in (0, CHUNK):
        for rank, result in enumerate(ranks):
            grads = result[chunk][2]
            assert grads.keys() == ref_grads.keys(), (chunk, sorted(grads), sorted(ref_grads))
            for name, ref in grads.items():
                torch.testing.assert_close(
                    ref, ref_grads[name], rtol=1e-4, atol=1e-5 * float(ref_grads[name].abs().max()),
                    msg=f"rank {rank}, chunk {chunk}: {name}",
                )  # fmt: skip
