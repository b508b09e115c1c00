"""The no-grad passes run micro-batches of their own budget (trainer.log_prob_max_token_len_per_gpu), the
update those of trainer.ppo_max_token_len_per_gpu, and every rank runs as many as the rank that needs the
most (one all_reduce of the count), on 2 gloo processes.

Each pass plans its micro-batches with the functions the recipes call: micro_rows for the no-grad passes
(old_and_ref_logprobs, values_of) and mini_batches for the update (update_policy, update_critic). Rank 0
holds 8 rows of 80 tokens (640), rank 1 8 rows of 20 (160): at a 160-token update budget rank 0 needs 4
micro-batches and rank 1 one, at a 640-token no-grad budget both need one; packed (the budget counts
tokens) and padded (it counts rows x the longest row) alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spmdrl.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

ROWS, PROMPT = 8, 8


def _batch(rank: int) -> Any:
    from spmdrl.rl.batch import PolicyBatch

    length, width = (80, 80) if rank == 0 else (20, 80)
    attn = torch.zeros(ROWS, width, dtype=torch.long)
    attn[:, :length] = 1
    resp = attn.clone()
    resp[:, :PROMPT] = 0
    zeros = torch.zeros(ROWS, width)
    return PolicyBatch(attn * 3, attn, resp, zeros, zeros.clone())


def _worker(rank: int, world: int, budgets: tuple[int, int], pack: bool) -> dict[str, list[list[int]]]:
    from spmdrl.config import Config, DataConfig, RolloutConfig, TrainerConfig, derive, derive_rl
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.update import micro_rows, mini_batches

    cfg = Config(
        data=DataConfig(max_prompt_length=PROMPT, max_response_length=72),
        trainer=TrainerConfig(
            global_batch_size=4,
            micro_batch_size=2,
            ppo_max_token_len_per_gpu=budgets[0],
            log_prob_max_token_len_per_gpu=budgets[1],
            pack_sequences=pack,
        ),
        rollout=RolloutConfig(n=4),
    )
    rl = derive_rl(cfg, derive(cfg, world, 100, samples_per_item=4))
    batch = _batch(rank)
    no_grad = [p.tolist() for p in micro_rows(cfg.trainer, rl, batch)]
    ((_, _, plans, _, _),) = list(mini_batches(update_settings(cfg), rl, batch, ("token-mean",)))
    return {"no_grad": no_grad, "update": [p.rows for p in plans]}


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_no_grad_passes_use_their_own_larger_budget_on_every_rank(pack: bool) -> None:
    out = run_distributed(_worker, 2, (160, 640), pack, timeout_s=120)
    for rank, got in enumerate(out):
        assert len(got["update"]) == 4, (rank, got)  # rank 1 needs 1, runs rank 0's 4
        assert len(got["no_grad"]) == 1, (rank, got)  # all 8 rows in one forward
        assert sorted(r for mb in got["update"] for r in mb) == list(range(ROWS))
    # 160 tokens each: packed, spread evenly (longest first onto the lightest); padded, consecutive runs.
    assert out[0]["update"] == (
        [[0, 4], [1, 5], [2, 6], [3, 7]] if pack else [[0, 1], [2, 3], [4, 5], [6, 7]]
    )


def test_sequence_counts_stay_available() -> None:
    """Both keys at 0: micro_batch_size (2) sequences per micro-batch in every pass, on every rank."""
    out = run_distributed(_worker, 2, (0, 0), False, timeout_s=120)
    for got in out:
        assert got["update"] == got["no_grad"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
