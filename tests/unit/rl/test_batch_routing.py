"""Router replay's routing in the rows (spmdrl.rl.batch): each generation's (positions, layers, k) choices
right-padded with -1 into (B, T, layers, k), and kept by the row operations the passes use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spmdrl.rl.batch import PolicyBatch, build_policy_batch
from spmdrl.rollout.engine import Generation


def _gen(prompt_index: int, tokens: list[int], prompt_len: int, seed: int) -> Generation:
    rng = np.random.default_rng(seed)
    # The engine ran every position but the last sampled token's.
    routed = rng.integers(0, 4, size=(prompt_len + len(tokens) - 1, 3, 2)).astype(np.int16)
    return Generation(prompt_index, tokens, [-0.5] * len(tokens), "stop", routed_experts=routed)


def test_rows_carry_each_generations_routing_padded_with_no_choice() -> None:
    prompts = [[1, 2, 3], [4, 5]]
    gens = [_gen(0, [7, 8], 3, 0), _gen(1, [9, 10, 11, 12], 2, 1), _gen(0, [13], 3, 2)]
    batch = build_policy_batch(prompts, gens, pad_id=0)
    r = batch.routed_experts_BTLK
    assert r is not None and r.shape == (3, 6, 3, 2) and r.dtype == torch.int16
    for i, g in enumerate(gens):
        n = g.routed_experts.shape[0]
        assert torch.equal(r[i, :n], torch.from_numpy(g.routed_experts))
        assert bool((r[i, n:] == -1).all())  # the last token and the padding: no choice
    # Micro-batch take, trimmed to the rows' width; concat pads with no choice, not expert 0.
    mb = batch.take(torch.tensor([0, 2]))
    assert mb.routed_experts_BTLK is not None and mb.routed_experts_BTLK.shape == (2, 5, 3, 2)
    both = PolicyBatch.concat([mb, batch.select(torch.tensor([1]))])
    assert both.routed_experts_BTLK is not None and both.routed_experts_BTLK.shape == (3, 6, 3, 2)
    assert bool((both.routed_experts_BTLK[0, 4:] == -1).all())


def test_rows_without_routing_have_none_and_mixed_generations_are_refused() -> None:
    plain = Generation(0, [7, 8], [-0.5, -0.5], "stop")
    assert build_policy_batch([[1, 2]], [plain], pad_id=0).routed_experts_BTLK is None
    with pytest.raises(ValueError, match="carry no routed experts while others do"):
        build_policy_batch([[1, 2, 3]], [_gen(0, [7], 3, 0), plain], pad_id=0)
