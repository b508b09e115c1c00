"""A golden trainer-side trajectory: 5 steps of the recipe's update_policy, metrics pinned in a file.

What it guards: the numbers the GRPO update produces from a fixed model and fixed batches. A change in
loss normalization (spmdrl/algos/aggregation.py), in the policy loss or the entropy, in the forward
(temperature, logprob gathering), in gradient clipping, or in the optimizer / schedule numerics (AdamW
via spmdrl.optim.build_optimizer) shows up as a mismatch in ``actor/pg_loss``, ``actor/entropy``,
``actor/grad_norm``, ``actor/pg_clipfrac`` or ``actor/ppo_kl`` at some step (later steps see the
weights the earlier optimizer steps produced), or in ``weights/update_norm``, the distance of the weights
from the initial ones after each step. That last one is recorded because at lr 2e-4 the logged metrics
barely feel the optimizer (a 5% lr change moves grad_norm by ~1e-4 relative, AdamW's eps by 1e-6 not
at all), while it moves by 5% and 1% respectively. Intended changes are fine, but must be deliberate:
refresh the file and say so in the change.

The set-up: the tiny Qwen2 of ``save_small_qwen2`` (its default seed), world size 1 through
``run_distributed`` (so FSDP2 and the real build path, ``spmdrl.rl.models.build_models``, are
used), grpo_tiny's algorithm and optim sections as the config loader composes them
(``recipe=grpo_tiny``: clip ratios 0.2 / 0.28, token-mean, no KL loss, AdamW at lr 2e-4, constant
schedule), with the batch shape pinned here (4 prompts x 8 samples, micro-batches of 8) so that the
synthetic data does not depend on the yaml's trainer section. Each step's batch is synthetic and
seeded: random token ids, prompts and responses of different lengths, one random advantage per
sequence, and "engine" logprobs = the trainer's own logprobs + seeded noise. Rewards play no part.
Under grpo_tiny's settings (one mini-batch, one PPO epoch) the update is on-policy, so
``pg_clipfrac`` and ``ppo_kl`` are 0 and ``pg_loss`` is the token-mean of -advantage by construction
(the ratio is exactly 1): the golden file pins that too, so pg_loss guards the normalization there.

Refresh on purpose only:

    SPMDRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/integration/test_golden_update.py

rewrites tests/integration/golden/grpo_update.json (the test then passes and prints that it did).

Trainer-side only: engine samples depend on the CPU's GEMM kernels (vLLM's CPU paths pick different
kernels per CPU model), so a golden rollout would not be portable; the update on given tokens is.
Tolerance: relative 1e-4, absolute 1e-6. CPU float32 kernels (oneDNN / MKL / the vectorized
reductions) differ in summation order between CPU models, which moves the last few bits: forcing
ATen's non-vectorized kernels (ATEN_CPU_CAPABILITY=default) moved every value by <= 3e-6 relative
(pg_loss near 0 by ~1e-8 absolute), two threads instead of one by nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from spmdrl.testing.models import padded_rows, save_small_qwen2
from spmdrl.testing.spawn import run_distributed

# ATen's float32 kernels differ per CPU kind (the tolerance above): CI runs it as every kind.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_kinds]

GOLDEN = Path(__file__).parent / "golden" / "grpo_update.json"
UPDATE_ENV = "SPMDRL_UPDATE_GOLDEN"
STEPS = 5
PROMPTS, N, MICRO = 4, 8, 8  # 32 rows per step, 4 micro-batches of 8
VOCAB = 64  # save_small_qwen2's vocabulary
KEYS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl")
# Not a logged metric: ||weights - initial weights|| after the step, what pins the optimizer numerics.
UPDATE_NORM = "weights/update_norm"
REL, ABS = 1e-4, 1e-6


def _config() -> Any:
    """grpo_tiny as the loader composes it, with the batch shape pinned."""
    from spmdrl.config_loader import load_config

    cfg = load_config(["recipe=grpo_tiny"])
    return dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(cfg.trainer, global_batch_size=PROMPTS, micro_batch_size=MICRO),
        rollout=dataclasses.replace(cfg.rollout, n=N),
    )


def _settings(cfg: Any) -> dict[str, Any]:
    """What the trajectory depends on besides the code (stored in the golden file, to explain a mismatch)."""
    return {
        "algorithm": dataclasses.asdict(cfg.algorithm),
        "optim": dataclasses.asdict(cfg.optim),
        "rollout.n": cfg.rollout.n,
        "rollout.temperature": cfg.rollout.temperature,
        "data.max_response_length": cfg.data.max_response_length,
        "trainer.global_batch_size": cfg.trainer.global_batch_size,
        "trainer.micro_batch_size": cfg.trainer.micro_batch_size,
        "steps": STEPS,
    }


def _synthetic_batch(step: int, max_response: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    B = PROMPTS * N
    prompt_len = torch.randint(4, 13, (B,), generator=g)
    resp_len = torch.randint(1, max_response + 1, (B,), generator=g)
    ids, attn, resp = padded_rows(prompt_len, resp_len, VOCAB, g)
    T = ids.shape[1]
    adv = torch.randn(B, 1, generator=g) * resp
    noise = 0.05 * torch.randn(B, T, generator=g)
    return dict(ids=ids, attn=attn, resp=resp, adv=adv, noise=noise)


def _worker(rank: int, world: int, model_dir: str, cfg: Any) -> list[dict[str, float]]:
    from spmdrl.config import derive, derive_rl
    from spmdrl.distributed.placement import Placement
    from spmdrl.optim import build_lr_scheduler, build_optimizer
    from spmdrl.rl.batch import PolicyBatch
    from spmdrl.rl.micro_batches import micro_batch_rows
    from spmdrl.rl.models import build_models
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import logprobs_of, update_policy

    cpu = torch.device("cpu")
    derived = derive(cfg, world, PROMPTS * STEPS, samples_per_item=N)
    rl = derive_rl(cfg, derived)
    meshes = Placement.colocated(world).build_meshes("cpu")
    actor, ref = build_models(cfg.model, cfg.trainer, cfg.algorithm, cpu, meshes, Path(model_dir))
    optimizer = build_optimizer(actor, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, STEPS)
    initial = {n: p.detach().full_tensor().clone() for n, p in actor.named_parameters()}
    micro, temp = cfg.trainer.micro_batch_size, cfg.rollout.temperature
    recompute_old = cfg.algorithm.ppo_epochs > 1 or rl.mini_batches_per_step > 1
    trajectory = []
    for step in range(1, STEPS + 1):
        d = _synthetic_batch(step, cfg.data.max_response_length)
        batch = PolicyBatch(d["ids"], d["attn"], d["resp"], torch.zeros(d["ids"].shape), d["adv"])
        # The "engine" sampled from (nearly) the same policy: the trainer's logprobs plus seeded noise.
        engine_lp = (
            logprobs_of(
                actor, batch, micro_batch_rows(batch.attention_mask_BT.sum(1), micro_batch_size=micro), temp
            )
            + d["noise"]
        ) * d["resp"]
        batch = batch.replace(engine_logprobs_BT=engine_lp)
        # As the recipe's step 4 does.
        if recompute_old:
            batch = batch.replace(
                old_logprobs_BT=logprobs_of(
                    actor,
                    batch,
                    micro_batch_rows(batch.attention_mask_BT.sum(1), micro_batch_size=micro),
                    temp,
                )
            )
        if ref is not None:
            batch = batch.replace(
                ref_logprobs_BT=logprobs_of(
                    ref.model,
                    batch,
                    micro_batch_rows(batch.attention_mask_BT.sum(1), micro_batch_size=micro),
                    temp,
                )
            )
        metrics = update_policy(update_settings(cfg), rl, actor, optimizer, batch).metrics
        scheduler.step()
        with torch.no_grad():
            sq = sum(
                float(((p.full_tensor() - initial[n]).double() ** 2).sum())
                for n, p in actor.named_parameters()
            )
        trajectory.append({**{k: float(metrics[k]) for k in KEYS}, UPDATE_NORM: sq**0.5})
    return trajectory


@pytest.mark.guarantee("golden:update")
def test_grpo_update_matches_golden(tmp_path: Path) -> None:
    save_small_qwen2(tmp_path / "m")
    cfg = _config()
    (trajectory,) = run_distributed(_worker, 1, str(tmp_path / "m"), cfg)
    settings = _settings(cfg)
    if os.environ.get(UPDATE_ENV) == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        about = f"tests/integration/test_golden_update.py; refresh with {UPDATE_ENV}=1 (see its docstring)"
        GOLDEN.write_text(
            json.dumps({"about": about, "settings": settings, "steps": trajectory}, indent=2) + "\n"
        )
        print(f"{UPDATE_ENV}=1: rewrote {GOLDEN} with {len(trajectory)} steps")
        return
    assert GOLDEN.exists(), f"{GOLDEN} is missing; create it with {UPDATE_ENV}=1"
    golden = json.loads(GOLDEN.read_text())
    note = (
        ""
        if golden["settings"] == json.loads(json.dumps(settings))
        else " (the settings differ from the golden file's too: grpo_tiny.yaml or a config default changed)"
    )
    assert len(golden["steps"]) == len(trajectory) == STEPS
    mismatches = [
        f"step {i + 1} {k}: got {got[k]!r}, golden {want[k]!r}"
        for i, (got, want) in enumerate(zip(trajectory, golden["steps"], strict=True))
        for k in (*KEYS, UPDATE_NORM)
        if got[k] != pytest.approx(want[k], rel=REL, abs=ABS)
    ]
    assert not mismatches, (
        f"the update's numerics changed{note}; if that is intended, refresh with {UPDATE_ENV}=1:\n"
        + "\n".join(mismatches)
    )
