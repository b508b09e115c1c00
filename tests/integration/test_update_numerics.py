"""The recipe's update_policy is split-invariant: ranks x micro-batches give the one-device update.

spmdrl's loss convention (spmdrl/algos/aggregation.py): every loss term is this rank's sum / the
mini-batch's global count of units, gradients accumulate over micro-batches and FSDP *sums* them
over ranks. So 2 gloo ranks, each holding half the rows and splitting its mini-batches into
micro-batches, must produce the same weights as one process updating on the whole mini-batch at
once (world size 1, one micro-batch per mini-batch), for every aggregation mode, with one
mini-batch x one epoch (on-policy) and with 2 mini-batches x 2 PPO epochs (old logprobs recomputed
first, as the recipe does). And the same under HSDP (4 ranks = 2 replicas x 2 shards).

Rows have different prompt and response lengths (so token-mean and the seq-mean modes differ), the KL
loss is on against a reference model with *other* weights (so it has a gradient from the first step),
advantages are random. Float32 and SGD throughout: Adam divides by sqrt(v), so 1e-9 float noise on a
near-zero gradient becomes an lr-sized step and equal updates would look different.

Tolerance: float32 with a different reduction order (per-rank partial sums, then the gradient
reduce-scatter / all-reduce, and micro-batch widths that change the GEMM shapes) differs from the
one-device result by a few ulps per operation: observed differences are <= ~1e-7 on weights of size
~1e-2..1e-1, against SGD updates of up to ~1e-2..1e-1 (asserted to be far above the tolerance, so the
comparison proves something). Gradient clipping is off: a clipped gradient has norm 1 whatever its
scale, which would hide a wrong normalization (a world-size factor) from the weights.
Weights: rtol 1e-5, atol 1e-6; summed metrics (losses, grad norm): rtol 1e-5, atol 1e-7.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

VOCAB = 64  # save_small_qwen2's vocabulary
N = 2  # rollout.n: samples per prompt
PROMPTS = 8  # trainer.global_batch_size, in prompts: 16 rows in all
LR = 0.1
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# (ppo_mini_batch_size in prompts, ppo_epochs): one on-policy mini-batch; 2 mini-batches x 2 epochs.
SCHEDULES = {"1x1": (PROMPTS, 1), "2x2": (PROMPTS // 2, 2)}
HSDP_CASE = ("seq-mean-token-mean", "2x2")
# Rows hold 3..13 tokens: a budget of 20 gives micro-batches of 1..4 rows of uneven sizes.
TOKEN_BUDGET = 20

WEIGHT_TOL = dict(rtol=1e-5, atol=1e-6)
METRIC_TOL = dict(rel=1e-5, abs=1e-7)
# Loss terms summed over micro-batches and ranks (each already divided by the global count), and the
# gradient norm: these must agree however the batch is split. pg_clipfrac and ppo_kl are means of
# micro-batch means, which depend on the split by design.
SPLIT_INVARIANT_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


def _global_batch() -> dict[str, torch.Tensor]:
    """16 right-padded rows of different prompt and response lengths, in rank order (rank r of W holds
    rows [r * 16/W, (r+1) * 16/W))."""
    g = torch.Generator().manual_seed(0)
    B = PROMPTS * N
    prompt_len = torch.randint(2, 6, (B,), generator=g)
    resp_len = torch.randint(1, 9, (B,), generator=g)
    ids, attn, resp = padded_rows(prompt_len, resp_len, VOCAB, g)
    T = ids.shape[1]
    engine_lp = -torch.rand(B, T, generator=g) * resp
    adv = torch.randn(B, T, generator=g) * resp
    return dict(ids=ids, attn=attn, resp=resp, engine_lp=engine_lp, adv=adv)


def _one_process_order(world: int, mini_batches: int) -> list[int]:
    """The 1-process row order whose mini-batch m is the concatenation of every rank's mini-batch m."""
    per_rank = PROMPTS * N // world
    per_rank_mini = per_rank // mini_batches
    return [
        r * per_rank + m * per_rank_mini + i
        for m in range(mini_batches)
        for r in range(world)
        for i in range(per_rank_mini)
    ]


def _config(mode: str, schedule: str, world: int, split_world: int, variant: str = "") -> Any:
    """The config for a run on ``world`` ranks. ``split_world`` is the world the case is split over: on it
    each rank runs micro-batches of 2 rows (1 on 4 ranks); on 1 process one micro-batch is a mini-batch.
    ``variant`` "tokens": on the split world, micro-batches of up to TOKEN_BUDGET tokens (of any number of
    rows) with their sequences packed end to end instead."""
    from spmdrl.config import AlgorithmConfig, Config, DataConfig, OptimConfig, RolloutConfig, TrainerConfig

    mini, epochs = SCHEDULES[schedule]
    micro = mini * N if world == 1 else (2 if split_world == 2 else 1)
    return Config(
        data=DataConfig(max_prompt_length=8, max_response_length=8),
        trainer=TrainerConfig(
            global_batch_size=PROMPTS,
            micro_batch_size=micro,
            micro_batch_tokens=TOKEN_BUDGET if variant == "tokens" and world > 1 else 0,
            pack_sequences=variant == "tokens" and world > 1,
        ),
        rollout=RolloutConfig(n=N),
        # No clipping: a clipped gradient has norm 1 whatever its scale, which would hide a wrong
        # normalization (a world-size factor, a per-micro-batch mean) from the weight comparison.
        optim=OptimConfig(grad_clip=0.0),
        algorithm=AlgorithmConfig(
            loss_agg_mode=mode,
            ppo_mini_batch_size=mini,
            ppo_epochs=epochs,
            use_kl_loss=True,
            kl_loss_coef=0.1,
        ),
    )


def _worker(
    rank: int, world: int, model_dir: str, ref_dir: str, dp_replicate: int, cases: list[tuple]
) -> list[tuple[dict[str, torch.Tensor] | None, dict[str, float]]]:
    """Runs update_policy for each (mode, schedule, split_world) case from fresh models; returns rank 0's
    full state dict (None elsewhere) and the metrics."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from spmdrl.config import derive, derive_rl
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.micro_batches import micro_batch_rows
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import logprobs_of, update_policy

    cpu, f32 = torch.device("cpu"), torch.float32
    meshes = Placement.colocated(world, dp_replicate=dp_replicate).build_meshes("cpu")
    data = _global_batch()
    results = []
    for mode, schedule, split_world, *variant in cases:
        cfg = _config(mode, schedule, world, split_world, *variant)
        rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=N))
        if world == 1:
            rows = _one_process_order(split_world, rl.mini_batches_per_step)
            assert len(rows) == PROMPTS * N
        else:
            per_rank = PROMPTS * N // world
            rows = list(range(rank * per_rank, (rank + 1) * per_rank))
        batch = PolicyBatch(*(data[k][rows] for k in ("ids", "attn", "resp", "engine_lp", "adv")))
        actor = build_fsdp_model(ModelSpec(Path(model_dir), f32, f32), meshes.fsdp("actor"), cpu)
        # Before any forward, as the recipe does: FSDP2 leaves the root unit (embeddings, final norm)
        # unsharded after a forward (reshard_after_forward=False), and an optimizer built then would
        # hold those unsharded tensors, which never get a gradient: the root would silently not train.
        optimizer = torch.optim.SGD(actor.parameters(), lr=LR)
        ref = build_fsdp_model(ModelSpec(Path(ref_dir), f32, f32, train=False), meshes.fsdp("ref"), cpu)
        temp, t = cfg.rollout.temperature, cfg.trainer
        parts = micro_batch_rows(
            batch.attention_mask_BT.sum(1),
            micro_batch_size=t.micro_batch_size,
            token_budget=t.micro_batch_tokens,
        )
        batch = batch.replace(ref_logprobs_BT=logprobs_of(ref, batch, parts, temp, t.pack_sequences))
        if cfg.algorithm.ppo_epochs > 1 or rl.mini_batches_per_step > 1:  # as the recipe does
            batch = batch.replace(old_logprobs_BT=logprobs_of(actor, batch, parts, temp, t.pack_sequences))
        metrics = update_policy(update_settings(cfg), rl, actor, optimizer, batch).metrics
        state = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        results.append((state if rank == 0 else None, metrics))
        del actor, ref, optimizer
    return results


def _run(
    tmp: Path, world: int, cases: list[tuple], dp_replicate: int = 1
) -> dict[tuple, tuple[dict[str, torch.Tensor], dict[str, float]]]:
    model_dir, ref_dir = tmp / "actor", tmp / "ref"
    out = run_distributed(_worker, world, str(model_dir), str(ref_dir), dp_replicate, cases, timeout_s=600)
    for r in range(1, world):
        assert out[r] is not None
        for (_, m0), (_, mr) in zip(out[0], out[r], strict=True):
            assert m0 == mr, "every rank must log the same reduced metrics"
    return {case: res for case, res in zip(cases, out[0], strict=True)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("update_numerics")
    save_small_qwen2(tmp / "actor")
    save_small_qwen2(tmp / "ref", seed=1)  # other weights: the KL loss has a gradient from the start
    return tmp


TWO_RANK_CASES = [(mode, schedule, 2) for mode in MODES for schedule in SCHEDULES]
HSDP_CASES = [(*HSDP_CASE, 4)]


@pytest.fixture(scope="module")
def one_process(models: Path) -> dict:
    """Every case's 1-process reference, in one spawn."""
    return _run(models, 1, TWO_RANK_CASES + HSDP_CASES)


@pytest.fixture(scope="module")
def two_ranks(models: Path) -> dict:
    return _run(models, 2, TWO_RANK_CASES)


def _initial_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from spmdrl.models.build import read_safetensors

    return {k: v.clone() for k, v in read_safetensors(model_dir).items()}


def _assert_same_update(
    split: tuple[dict[str, torch.Tensor], dict[str, float]],
    whole: tuple[dict[str, torch.Tensor], dict[str, float]],
    initial: dict[str, torch.Tensor],
) -> None:
    (state, metrics), (ref_state, ref_metrics) = split, whole
    assert set(state) == set(ref_state)
    moved = _max_diff(ref_state, initial)
    assert moved > 100 * WEIGHT_TOL["atol"], f"the update moved weights by only {moved}: a vacuous comparison"
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], **WEIGHT_TOL, msg=lambda m, k=k: f"{k}: {m}")
    for key in SPLIT_INVARIANT_METRICS:
        assert metrics[key] == pytest.approx(ref_metrics[key], **METRIC_TOL), key


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_with_micro_batches_match_one_process(
    models: Path, one_process: dict, two_ranks: dict, mode: str, schedule: str
) -> None:
    case = (mode, schedule, 2)
    _assert_same_update(two_ranks[case], one_process[case], _initial_state(models / "actor"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def test_the_cases_differ(models: Path, one_process: dict) -> None:
    """The fixture is not degenerate: every parameter trains, and the modes (rows of different lengths)
    and the schedules give weights that differ far beyond the tolerance."""
    initial = _initial_state(models / "actor")
    for case, (state, _) in one_process.items():
        frozen = [k for k in initial if torch.equal(state[k], initial[k])]
        assert not frozen, f"{case}: parameters the update did not change: {frozen}"

    def weights(mode: str, schedule: str) -> dict[str, torch.Tensor]:
        return one_process[(mode, schedule, 2)][0]

    far = 100 * WEIGHT_TOL["atol"]
    for schedule in SCHEDULES:
        for i, a in enumerate(MODES):
            for b in MODES[i + 1 :]:
                assert _max_diff(weights(a, schedule), weights(b, schedule)) > far, (a, b, schedule)
    for mode in MODES:
        assert _max_diff(weights(mode, "1x1"), weights(mode, "2x2")) > far, mode
    assert one_process[("token-mean", "2x2", 2)][1]["actor/ppo_kl"] != 0  # later updates are off-policy


def test_hsdp_two_replicas_by_two_shards_match_one_process(models: Path, one_process: dict) -> None:
    hsdp = _run(models, 4, HSDP_CASES, dp_replicate=2)
    for case in HSDP_CASES:
        _assert_same_update(hsdp[case], one_process[case], _initial_state(models / "actor"))


def _optimizer_after_forward_worker(rank: int, world: int, model_dir: str) -> bool:
    from spmdrl.config import OptimConfig
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.optim import build_optimizer

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32), mesh, torch.device("cpu")
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)  # leaves the root unit unsharded (reshard_after_forward=False)
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    before = model.model.embed_tokens.weight.to_local().clone()
    model(input_ids=ids).logits.float().square().mean().backward()
    opt.step()
    return not torch.equal(before, model.model.embed_tokens.weight.to_local())


def test_optimizer_built_after_a_forward_still_trains_the_root(tmp_path: Path) -> None:
    """build_optimizer reshards first: built on the root's unsharded parameters, the embeddings and final
    norm would never get a gradient and never train (found while writing the numerics tests above)."""
    save_small_qwen2(tmp_path / "m")
    assert all(run_distributed(_optimizer_after_forward_worker, 2, str(tmp_path / "m")))


TOKEN_CASES = [("token-mean", "2x2", 2, "tokens"), ("seq-mean-token-sum-norm", "1x1", 2, "tokens")]


def test_token_budget_micro_batches_and_packing_match_one_process(models: Path, one_process: dict) -> None:
    """Micro-batches by token budget (uneven row counts per micro-batch) with the sequences packed end to
    end: the normalization does not change, so the update is still the one-device update."""
    split = _run(models, 2, TOKEN_CASES)
    for case in TOKEN_CASES:
        _assert_same_update(split[case], one_process[case[:3]], _initial_state(models / "actor"))
