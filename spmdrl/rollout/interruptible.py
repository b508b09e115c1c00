"""Single-turn generation that a weight update can interrupt between engine steps (partial rollouts).

:func:`generate_interruptible` runs one batch through the engine's request-level loop
(:class:`~spmdrl.rollout.engine.EngineStepper`, as the agent loop does) and asks ``poll()`` before every
engine step whether new weights are waiting. When they are, it reads what every unfinished request has
sampled so far, aborts them all, calls ``switch()`` (the caller's weight sync, which loads the new
weights and returns their version) and resubmits them:

- ``continue``: the prompt plus the tokens sampled so far is the new prompt, for the remaining
  ``max_tokens``. The new weights recompute the whole prefix's KV cache, so every later token is sampled
  from, and its logprob is, exactly the new policy given its exact prefix, and every earlier token keeps
  the logprob of the policy that sampled it. Each token records the version that sampled it.
- ``abort``: the sample restarts from its prompt; all of its tokens then come from the new weights.

Requests that finished before the switch are untouched. A sample's first request has the seed
:meth:`RolloutEngine.generate` would give it (with ``poll`` never firing the output is a plain generate's);
a resubmission gets a seed of its own, mixed from the same keys plus the switch's number, so a resumed
sample samples afresh, deterministically given where the switch landed.

The ranks of one engine (a TP group) must interrupt at the same step: the group's first rank polls and
broadcasts its answer over the group's gloo subgroup each step (nothing to send at tp=1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from spmdrl.rollout.engine import EngineStepper, Generation, RolloutEngine, SamplingSpec, request_seed

PARTIAL_MODES = ("continue", "abort")


@dataclass
class VersionedGenerations:
    """What :func:`generate_interruptible` returns for this rank's prompts, grouped by prompt in order."""

    generations: list[Generation]
    # Per sample, per token: the policy version whose weights sampled it (and computed its logprob).
    # (Each Generation holds its own too, Generation.versions / .interrupted: they follow it wherever it
    # goes, through dynamic sampling's kept groups say.)
    versions: list[list[int]]
    # Per sample: whether a switch landed while it was unfinished (it was resubmitted).
    interrupted: list[bool]
    # Weight switches during the call, and tokens the engine prefilled again because of them (continue:
    # each interrupted sample's tokens so far) or threw away (abort).
    switches: int = 0
    recomputed_tokens: int = 0
    discarded_tokens: int = 0


@dataclass
class _Sample:
    prompt: int
    sample: int
    prompt_ids: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    interrupted: bool = False

    def request_id(self, attempt: int) -> str:
        return f"p{self.prompt}-s{self.sample}-a{attempt}"


def generate_interruptible(
    engine: RolloutEngine,
    prompts: Sequence[list[int]],
    spec: SamplingSpec,
    *,
    version: int,
    poll: Callable[[], bool],
    switch: Callable[[], int],
    mode: str,
) -> VersionedGenerations:
    """``spec.n`` samples per prompt of this rank, as :meth:`RolloutEngine.generate` returns them, started
    on the weights of policy ``version``. Every rank of the engine calls it together.

    ``poll()`` is asked before each engine step (on the TP group's first rank) and must return True once
    per new set of weights; ``switch()`` then runs on every rank of the engine with no request in flight,
    loads those weights into the engine and returns their version. ``mode``: "continue" or "abort".
    """
    if mode not in PARTIAL_MODES:
        raise ValueError(
            f"generate_interruptible: mode must be one of {', '.join(PARTIAL_MODES)}, got {mode!r}"
        )
    groups = engine.groups
    gathered = groups.gather_for_tp([list(p) for p in prompts])
    base = spec.seed if spec.seed is not None else 0  # (generate's own counter is the engine's business)
    # vLLM gives the n samples of a request seeded s the seeds s, s+1, ..., s+n-1.
    samples = [
        _Sample(i, s, p, request_seed(base, groups.dp_index, i) + s)
        for i, p in enumerate(gathered.prompts)
        for s in range(spec.n)
    ]
    result = VersionedGenerations([], [], [])
    pending = list(samples)
    while pending:
        cut = _run_until_poll(engine, pending, spec, version, poll, result.switches)
        if not cut:
            break
        version = switch()
        result.switches += 1
        for s in cut:
            s.interrupted = True
            # The resubmission's own seed: deterministic given the switch, not a replay of the old stream.
            s.seed = request_seed(base, groups.dp_index, s.prompt, s.sample, result.switches)
            if mode == "continue":
                result.recomputed_tokens += len(s.ids)
            else:
                result.discarded_tokens += len(s.ids)
                s.ids, s.logprobs, s.versions = [], [], []
        pending = cut
    gens = [
        Generation(
            s.prompt,
            s.ids,
            s.logprobs if spec.logprobs else [],
            s.finish_reason,
            versions=s.versions,
            interrupted=s.interrupted,
        )
        for s in samples
    ]
    n = spec.n
    result.generations = [
        replace(g, prompt_index=g.prompt_index - gathered.start)
        for g in groups.scatter_from_tp(gens, gathered, per_prompt=n)
    ]
    result.versions = groups.scatter_from_tp([s.versions for s in samples], gathered, per_prompt=n)
    result.interrupted = groups.scatter_from_tp([s.interrupted for s in samples], gathered, per_prompt=n)
    return result


def _run_until_poll(
    engine: RolloutEngine,
    pending: list[_Sample],
    spec: SamplingSpec,
    version: int,
    poll: Callable[[], bool],
    attempt: int,
) -> list[_Sample]:
    """Step ``pending`` until all finish (returns []) or ``poll`` fires: then the unfinished samples, their
    tokens so far appended (continue) and their requests aborted (the stepper's exit aborts them)."""
    by_id: dict[str, _Sample] = {}
    with engine.stepper() as stepper:
        for s in pending:
            rid = s.request_id(attempt)
            by_id[rid] = s
            params = replace(spec, n=1, seed=s.seed, max_tokens=spec.max_tokens - len(s.ids))
            stepper.add(rid, s.prompt_ids + s.ids, params, track_partial=True)
        while stepper.num_unfinished():
            if _agreed_poll(poll, engine):
                return _cut(stepper, by_id, version)
            for out in stepper.step():
                s = by_id.pop(out.request_id)
                s.ids += out.token_ids
                s.logprobs += out.logprobs
                s.versions += [version] * len(out.token_ids)
                s.finish_reason = out.finish_reason
    return []


def _cut(stepper: EngineStepper, by_id: dict[str, _Sample], version: int) -> list[_Sample]:
    cut = []
    for rid, s in by_id.items():
        part = stepper.partial(rid)
        if part is not None:
            s.ids += part.token_ids
            s.logprobs += part.logprobs
            s.versions += [version] * len(part.token_ids)
        cut.append(s)
    return cut


def _agreed_poll(poll: Callable[[], bool], engine: RolloutEngine) -> bool:
    """``poll()`` on the engine's first rank, the same answer on all of its ranks."""
    groups = engine.groups
    if groups.group is None:
        return poll()
    box: list[bool | None] = [poll() if groups.tp_rank == 0 else None]
    dist.broadcast_object_list(box, group_src=0, group=groups.group)
    return bool(box[0])
