"""model.compile: torch.compile per decoder block under FSDP2 (gloo, 2 CPU processes) gives the eager
model's logprobs and gradients.

Tolerance: inductor fuses and reorders float32 reductions (RMSNorm, softmax, the SwiGLU product), so the
results differ from eager by float32 rounding, not bitwise: observed <= 5e-7 on logprobs of size ~4 and
<= 3e-8 on gradients of size ~1e-3..1e-1 on the small Qwen2. Asserted: logprobs atol 1e-5, gradients
atol 1e-6 (rtol 1e-4), far below the gradients' own size (also asserted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
    out = {}
    for compiled in (False, True):
        spec = ModelSpec(Path(model_dir), torch.float32, torch.float32, compile=compiled)
        model = build_fsdp_model(spec, mesh, torch.device("cpu"))
        params = list(model.parameters())  # the sharded ones: before any forward
        logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[:, :-1]
        logprobs = logprobs.gather(-1, ids[:, 1:, None])[..., 0]
        (-logprobs.mean()).backward()
        compiled_layers = [
            getattr(layer, "_compiled_call_impl", None) is not None for layer in model.model.layers
        ]
        out[compiled] = dict(
            logprobs=logprobs.detach(),
            grads=[p.grad.full_tensor() for p in params],
            names=[n for n, _ in model.named_parameters()],
            compiled_layers=compiled_layers,
        )
    return out


def test_compiled_blocks_match_eager_on_two_ranks(tmp_path: Path) -> None:
    save_small_qwen2(tmp_path / "m")
    for res in run_distributed(_worker, 2, str(tmp_path / "m"), timeout_s=900):
        eager, compiled = res[False], res[True]
        assert compiled["compiled_layers"] == [True, True] and eager["compiled_layers"] == [False, False]
        assert compiled["names"] == eager["names"]  # no _orig_mod: checkpoints and the sync see eager names
        torch.testing.assert_close(compiled["logprobs"], eager["logprobs"], rtol=1e-4, atol=1e-5)
        for g_c, g_e in zip(compiled["grads"], eager["grads"], strict=True):
            assert g_e.abs().max() > 1e-4  # the tolerance is far below what is compared
            torch.testing.assert_close(g_c, g_e, rtol=1e-4, atol=1e-6)
