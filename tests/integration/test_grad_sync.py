"""FSDP2 settings of the trained models: trainer.defer_grad_sync reduce-scatters once per optimizer step
and gives the same update (auto: on one rank only); a one-rank mesh leaves no gathered copy after a
no-grad forward, with per-layer units or one unit for the whole model, which the update gathers once per
mini-batch.

2 gloo ranks, 4 micro-batches per rank in one mini-batch, SGD, no clipping. The reduce-scatters are
counted by wrapping FSDP2's own foreach_reduce (it still runs), the gathers by wrapping its unshard. Deferring changes the order of the sums
(micro-batches summed per rank before the cross-rank sum instead of after), so the weights agree to
float32 rounding (rtol 1e-5, atol 1e-6, as tests/integration/test_update_numerics.py), not bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

N, PROMPTS = 2, 4  # 8 rows: 4 per rank, micro-batches of 1


def _worker(rank: int, world: int, model_dir: str, unit: str = "auto") -> dict:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.tensor import DTensor

    from spmdrl.config import (
        AlgorithmConfig,
        Config,
        OptimConfig,
        RolloutConfig,
        TrainerConfig,
        derive,
        derive_rl,
    )
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.grad_sync import defers_grad_sync
    from spmdrl.models.parallelize import shard_ranks
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import update_policy

    calls, gathers = [0], [0]
    real = param_group.foreach_reduce
    real_unshard = param_group.FSDPParamGroup.unshard

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return real(*args, **kwargs)

    def counted_unshard(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        gathers[0] += not self.is_unsharded and self._all_gather_result is None  # a gather, not a no-op
        return real_unshard(self, *args, **kwargs)

    param_group.foreach_reduce = counted
    param_group.FSDPParamGroup.unshard = counted_unshard
    g = torch.Generator().manual_seed(0)
    B = PROMPTS * N
    ids, attn, resp = padded_rows(
        torch.randint(2, 6, (B,), generator=g), torch.randint(1, 9, (B,), generator=g), 64, g
    )
    engine_lp = -torch.rand(ids.shape, generator=g) * resp
    adv = torch.randn(ids.shape, generator=g) * resp
    rows = slice(rank * B // world, (rank + 1) * B // world)
    batch = PolicyBatch(ids[rows], attn[rows], resp[rows], engine_lp[rows], adv[rows])
    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    out: dict = {}
    for defer in ("false", "true", "auto"):
        cfg = Config(
            trainer=TrainerConfig(global_batch_size=PROMPTS, micro_batch_size=1, defer_grad_sync=defer),
            rollout=RolloutConfig(n=N),
            optim=OptimConfig(grad_clip=0.0),
            algorithm=AlgorithmConfig(use_kl_loss=False),
        )
        rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=N))
        actor = build_fsdp_model(
            ModelSpec(Path(model_dir), torch.float32, torch.float32, fsdp_unit=unit),
            mesh,
            torch.device("cpu"),
        )
        optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
        params = optimizer.param_groups[0]["params"]
        calls[0] = gathers[0] = 0
        metrics = update_policy(update_settings(cfg), rl, actor, optimizer, batch).metrics
        out[defer] = dict(
            reduces=calls[0], gathers=gathers[0], metrics=metrics, weights=[p.full_tensor() for p in params]
        )
    # Each mode left the model as it found it: resharded, its gradients reduced at every backward.
    assert all(isinstance(p, DTensor) for p in actor.parameters())
    # After a forward, a layer's parameters are plain (unsharded) tensors only where it was not resharded.
    with torch.no_grad():
        actor(input_ids=batch.input_ids_BT)
    out["layer_sharded_after_forward"] = isinstance(next(actor.model.layers[0].parameters()), DTensor)
    # Resolved from how the model was sharded, not from its parameters, which the root of per-layer units
    # leaves gathered (plain tensors) after that no-grad forward.
    out["auto_after_forward"] = (shard_ranks(actor), defers_grad_sync(actor, "auto"))
    return out


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grad_sync") / "m"
    save_small_qwen2(path)
    return path


def test_deferred_sync_reduces_once_per_step_and_gives_the_same_update(model_dir: Path) -> None:
    """On 2 ranks auto (the default) does not defer: the unsharded gradients would cost memory there."""
    out = run_distributed(_worker, 2, str(model_dir), timeout_s=600)
    units = 3  # two decoder layers and the root
    for res in out:
        each, once = res["false"], res["true"]
        assert each["reduces"] == 4 * units and once["reduces"] == units
        assert res["auto"]["reduces"] == 4 * units and _bitwise(res["auto"]["weights"], each["weights"])
        for w_once, w_each in zip(once["weights"], each["weights"], strict=True):
            torch.testing.assert_close(w_once, w_each, rtol=1e-5, atol=1e-6)
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert once["metrics"][key] == pytest.approx(each["metrics"][key], rel=1e-5, abs=1e-7), key
        assert each["metrics"]["actor/grad_norm"] > 1e-3
        assert res["layer_sharded_after_forward"]  # 2 ranks: resharded after forward
        assert res["auto_after_forward"] == (2, False)


@pytest.mark.parametrize(("unit", "units"), [("layer", 3), ("auto", 1)])
def test_one_rank_reshards_after_a_no_grad_forward(model_dir: Path, unit: str, units: int) -> None:
    """Kept unsharded, a one-rank model would hold a copy of itself after every no-grad pass: per-layer
    units reshard their layers after forward, the whole-model unit (auto on one rank, model.fsdp_unit)
    reshards after a no-grad forward; deferring reduces once per unit per step either way, and auto
    defers on one rank, whose shard is the whole gradient. The whole-model unit is gathered once per
    mini-batch, not once per micro-batch: its weights do not change before the optimizer step."""
    (res,) = run_distributed(_worker, 1, str(model_dir), unit, timeout_s=600)
    assert res["layer_sharded_after_forward"]
    assert res["auto_after_forward"] == (1, True)
    assert res["false"]["reduces"] == 8 * units  # 8 rows: 8 micro-batches
    assert res["true"]["reduces"] == res["auto"]["reduces"] == units
    assert _bitwise(res["auto"]["weights"], res["true"]["weights"])
    for w_once, w_each in zip(res["true"]["weights"], res["false"]["weights"], strict=True):
        torch.testing.assert_close(w_once, w_each, rtol=1e-5, atol=1e-6)
    if unit == "auto":  # one unit, one mini-batch: one gather in every mode
        assert [res[m]["gathers"] for m in ("false", "true", "auto")] == [1, 1, 1]
    else:  # each layer unit gathers in each forward and again in its backward
        assert res["false"]["gathers"] >= 8 * 2 * (units - 1)


def test_sft_step_defers_on_one_rank(tmp_path: Path) -> None:
    """The SFT recipe's step goes through the same rule (spmdrl.models.grad_sync): on one rank auto reduces
    once per step, false after each of its 2 micro-batches. Counted as FSDP2's own post-backward reduce
    ranges in the traced step (logging.profile_steps); one torchrun process each."""
    import functools
    import gzip
    import json
    import os

    from spmdrl.testing.launch import JobResult, torchrun
    from spmdrl.testing.spawn import side_by_side

    def job(mode: str) -> JobResult:
        return torchrun(
            [
                "-m",
                "spmdrl.train",
                "recipe=sft_tiny",
                f"trainer.output_dir={tmp_path / mode}",
                "trainer.total_steps=2",
                "trainer.global_batch_size=16",
                "trainer.micro_batch_size=8",
                "trainer.val_every=0",
                "logging.profile_steps=[2]",
                f"trainer.defer_grad_sync={mode}",
                # One torch thread each: the two jobs run side by side (by default each would take every core).
                "trainer.cpu_threads=1",
            ],
            nproc=1,
            cwd=tmp_path,
            timeout_s=600,
            env={"SPMDRL_CACHE": os.environ.get("SPMDRL_CACHE", str(Path.home() / ".cache" / "spmdrl"))},
        )

    modes = ("auto", "false")
    counts = {}
    for mode, res in zip(modes, side_by_side([functools.partial(job, m) for m in modes]), strict=True):
        assert res.returncode == 0, res.output[-4000:]
        trace = json.loads(
            gzip.decompress((tmp_path / mode / "profile" / "step-2" / "rank-0.json.gz").read_bytes())
        )
        counts[mode] = sum(e.get("name") == "FSDP::post_backward_reduce" for e in trace["traceEvents"])
    assert counts == {"auto": 1, "false": 2}
