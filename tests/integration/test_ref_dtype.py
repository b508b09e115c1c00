"""The frozen reference is stored in model.param_dtype: with param_dtype=bfloat16 (CUDA's default; here
forced on CPU) its FSDP2 shards are bf16, and its logprobs are bitwise those of fp32 shards cast to bf16
at every forward (what it was before: the cast happens once, at load, with the same rounding).

2 gloo ranks; the cast-per-forward model is the same checkpoint built as a trained model (fp32 master
shards, FSDP2's mixed precision) and run without gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.config import ModelConfig
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import build_fsdp_model, model_spec
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.update import logprobs_of

    cpu = torch.device("cpu")
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("ref")
    g = torch.Generator().manual_seed(rank)
    ids, attn, resp = padded_rows(
        torch.randint(2, 6, (4,), generator=g), torch.randint(1, 9, (4,), generator=g), 64, g
    )
    batch = PolicyBatch(ids, attn, resp, torch.zeros(ids.shape), torch.zeros(ids.shape))
    cfg = ModelConfig(param_dtype="bfloat16")
    parts = [torch.arange(2), torch.arange(2, 4)]
    out = {}
    for train in (False, True):  # the reference as built; the same weights as fp32 shards cast per forward
        model = build_fsdp_model(model_spec(cfg, Path(model_dir), cpu, train=train), mesh, cpu)
        out[train] = dict(
            dtypes={p.to_local().dtype for p in model.parameters()},
            bytes=sum(p.to_local().nbytes for p in model.parameters()),
            logprobs=logprobs_of(model, batch, parts, temperature=1.0),
            resp=resp,
        )
    return out


def test_reference_is_stored_in_bf16_with_the_same_logprobs(tmp_path: Path) -> None:
    save_small_qwen2(tmp_path / "m")
    for res in run_distributed(_worker, 2, str(tmp_path / "m"), timeout_s=600):
        ref, cast_per_forward = res[False], res[True]
        assert ref["dtypes"] == {torch.bfloat16} and cast_per_forward["dtypes"] == {torch.float32}
        assert 2 * ref["bytes"] == cast_per_forward["bytes"]
        assert torch.equal(ref["logprobs"], cast_per_forward["logprobs"])
        assert ref["logprobs"][res[False]["resp"]].abs().min() > 0  # real logprobs on every response token
