"""Preference pairs sampled from a policy (recipes/rm.py, rm.pairs=policy): the way reward models of real
pipelines get their data. Every rank generates ``n`` samples for its shard of the prompts with the
in-process engine, the rule reward (the tiny task's ``####`` check) labels each, and a prompt whose samples
disagree gives pairs: a correct sample chosen, an incorrect one of the same prompt rejected. A prompt whose
samples all agree gives none. The pairs are gathered on every rank, in prompt order, so every rank holds the
same list (the sampler's and validation's indices are global).

The reward model then learns to rank exactly the mistakes the policy makes (the warm-started tiny policy's
are systematic: one too high), which hand-made wrong answers (spmdrl/data/tiny_pairs.py) only guess at.
"""

from __future__ import annotations

import random
import re
from typing import Any

import torch.distributed as dist

from spmdrl.data.prompts import encode, render_prompt
from spmdrl.data.tiny_pairs import PreferencePair
from spmdrl.rewards.tiny import compute_score
from spmdrl.rollout.engine import RolloutEngine, SamplingSpec

_ANSWER = re.compile(r"#### (-?\d+)\s*$")


def pairs_from_samples(
    messages: list[dict[str, str]], responses: list[str], truth: str, max_pairs: int, rng: random.Random
) -> list[PreferencePair]:
    """Up to ``max_pairs`` pairs of one prompt: distinct correct responses chosen, distinct incorrect ones
    rejected, each used as evenly as the counts allow; none when the samples all agree."""
    right = sorted({r for r in responses if compute_score(r, truth) >= 1.0})
    wrong = sorted({r for r in responses if compute_score(r, truth) < 1.0})
    if not right or not wrong:
        return []
    rng.shuffle(right)
    rng.shuffle(wrong)
    count = min(max_pairs, max(len(right), len(wrong)))
    return [
        PreferencePair(list(messages), right[i % len(right)], wrong[i % len(wrong)]) for i in range(count)
    ]


def _final_answer(response: str) -> int | None:
    m = _ANSWER.search(response)
    return int(m.group(1)) if m else None


def balance_directions(pairs: list[PreferencePair], seed: int) -> list[PreferencePair]:
    """The pairs with as many rejected answers above the chosen one as below it (the larger side
    subsampled; pairs whose answers do not both parse are kept). A policy whose mistakes lean one way (the
    warm-started tiny policy's are one too high) otherwise teaches a reward model "smaller is better", which
    GRPO exploits within a few steps by answering 0 (docs/rewards.md)."""
    above, below, other = [], [], []
    for i, p in enumerate(pairs):
        c, r = _final_answer(p.chosen), _final_answer(p.rejected)
        (other if c is None or r is None else above if r > c else below).append(i)
    rng = random.Random(f"policy_pairs/balance/{seed}")
    n = min(len(above), len(below))
    keep = set(rng.sample(above, n) + rng.sample(below, n) + other)
    return [p for i, p in enumerate(pairs) if i in keep]


def sample_policy_pairs(
    engine: RolloutEngine,
    tokenizer: Any,
    rows: list[dict],
    spec: SamplingSpec,
    *,
    max_pairs_per_prompt: int,
    seed: int,
    rank: int,
    world_size: int,
) -> tuple[list[PreferencePair], dict[str, float]]:
    """Pairs from the policy's samples of ``rows`` (tiny-task rows: ``prompt``, ``reward_model.ground_truth``),
    the same list on every rank; and counts: prompts, samples, the samples' accuracy, prompts with a pair.
    Every rank calls it together."""
    mine = list(range(rank, len(rows), world_size))
    ids = [
        encode(tokenizer, render_prompt(tokenizer, list(rows[i]["prompt"]), where="rm pairs")) for i in mine
    ]
    gens = engine.generate(ids, spec)
    texts = tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)
    by_prompt: dict[int, list[str]] = {}
    for g, text in zip(gens, texts, strict=True):
        by_prompt.setdefault(g.prompt_index, []).append(text)
    local: list[tuple[int, list[PreferencePair], int, int]] = []  # (row, pairs, samples, right)
    for j, i in enumerate(mine):
        row, responses = rows[i], by_prompt.get(j, [])
        truth = str(row["reward_model"]["ground_truth"])
        rng = random.Random(f"policy_pairs/{seed}/{i}")
        pairs = pairs_from_samples(list(row["prompt"]), responses, truth, max_pairs_per_prompt, rng)
        right = sum(compute_score(r, truth) >= 1.0 for r in responses)
        local.append((i, pairs, len(responses), right))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    everything = sorted((x for part in gathered for x in part), key=lambda x: x[0])
    pairs = [p for _, ps, _, _ in everything for p in ps]
    samples = sum(n for _, _, n, _ in everything)
    stats = {
        "prompts": float(len(everything)),
        "samples": float(samples),
        "sample_accuracy": sum(r for _, _, _, r in everything) / max(samples, 1),
        "prompts_with_pairs": float(sum(bool(ps) for _, ps, _, _ in everything)),
        "pairs": float(len(pairs)),
    }
    return pairs, stats
