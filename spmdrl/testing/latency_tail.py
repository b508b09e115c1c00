"""A simulated long tail of generation latency, for benchmarks and tests: spmdrl.train with every job's
Rollout wrapped so that some training prompts are slow (docs/rollout.md#simulated-latency-tail).

    torchrun --nproc_per_node=2 -m spmdrl.testing.latency_tail --prompts 2 --seconds 3 recipe=grpo_tiny ...

Each rank runs this launcher instead of ``-m spmdrl.train``: it reads ``--prompts`` and ``--seconds``,
parses the rest as spmdrl.train does (spmdrl.train.parse_config), checks the tail against that config,
installs :class:`LatencyTailRollout` around the job's Rollout (spmdrl.rollout.rollout.wrap_rollouts, in
this process) and runs the recipe (spmdrl.train.run_entry). The user's config knows nothing of it.

In each training generate call on each rank, ``prompts`` of the call's prompts are slow: the call returns
``seconds`` after the engine is done, as a batched engine waits for its slowest request. It models waiting
that leaves the generating rank idle (a slow tool call, an environment, a remote judge), not compute: the
rank sleeps. Validation calls are never slowed. With partial rollouts (rollout.partial) the wait stalls
the interruptible generation after its first engine step instead, its requests in flight, so a weight
update lands mid-generation. The wait is reported as the Rollout's (Rollout.take_wait_seconds):
``rollout/wait_s``, inside ``timing/rollout_s``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spmdrl.data.prompts import PromptExample
from spmdrl.errors import ConfigError
from spmdrl.rollout.engine import Generation, SamplingSpec, request_seed
from spmdrl.rollout.interruptible import VersionedGenerations
from spmdrl.rollout.rollout import Rollout, wrap_rollouts

if TYPE_CHECKING:
    from spmdrl.config import Config

PROG = "python -m spmdrl.testing.latency_tail"


@dataclass(frozen=True)
class LatencyTail:
    """The tail: ``prompts`` slow prompts per training generate call on each rank (a rank holding fewer:
    all of them), each call ``seconds`` late when any is slow. 0 in either: off."""

    prompts: int = 0
    seconds: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.prompts > 0 and self.seconds > 0

    def check(self, cfg: Config) -> None:
        """No negative values, no more slow prompts than a step has, and a wait the other ranks'
        collectives outlast."""
        if self.prompts < 0 or self.seconds < 0:
            raise ConfigError(
                f"latency tail: --prompts and --seconds must be >= 0 (0: no tail), got {self.prompts}, "
                f"{self.seconds}"
            )
        if self.prompts > cfg.trainer.global_batch_size:
            raise ConfigError(
                f"latency tail: --prompts {self.prompts} is more than the step's batch "
                f"(trainer.global_batch_size={cfg.trainer.global_batch_size} prompts); it counts slow "
                "prompts per generate call on each rank: lower it"
            )
        if self.seconds >= cfg.trainer.collective_timeout_min * 60:
            raise ConfigError(
                f"latency tail: --seconds {self.seconds} must stay below trainer.collective_timeout_min="
                f"{cfg.trainer.collective_timeout_min} minutes: the other ranks wait in a collective while a "
                "rank waits out its slow prompts"
            )


def slow_prompts(num_prompts: int, count: int, seed: int) -> list[int]:
    """The indices (sorted) of the ``count`` prompts of a generate call that are slow: a choice seeded by
    ``seed`` alone, so the same call picks the same prompts on any host and run. All of them when the call
    holds fewer than ``count``."""
    if count >= num_prompts:
        return list(range(num_prompts))
    return sorted(random.Random(seed).sample(range(num_prompts), count))


class LatencyTailRollout(Rollout):
    """``inner`` with the tail: its training calls wait ``tail.seconds`` when one of their prompts is slow.
    Which are slow is seeded by the call's sampling seed (its own call count without one) and the engine's
    index, so a resumed run picks the same ones."""

    def __init__(self, inner: Rollout, tail: LatencyTail) -> None:
        super().__init__(inner.engine, inner.agent, group=inner.group)
        self.inner, self.tail = inner, tail
        self._wait_s = 0.0  # waited since the last take
        self._calls = 0
        self.last_slow_prompts: list[int] = []  # the latest training call's slow prompts (indices)

    def generate(
        self, prompts: Sequence[PromptExample], spec: SamplingSpec, *, training: bool = True
    ) -> list[Generation]:
        self._calls += 1
        gens = self.inner.generate(prompts, spec, training=training)
        if training and self._choose(len(prompts), spec.seed):
            self._wait()
        return gens

    def generate_interruptible(
        self,
        prompts: Sequence[PromptExample],
        spec: SamplingSpec,
        *,
        version: int,
        poll: Callable[[], bool],
        switch: Callable[[], int],
        mode: str,
    ) -> VersionedGenerations:
        """The inner call, stalled at its second poll (after the first engine step: the requests stay in
        flight while it waits) when a prompt is slow, so an update can land in the middle of a slow batch."""
        self._calls += 1
        slow = bool(self._choose(len(prompts), spec.seed))
        polls = 0

        def stalling_poll() -> bool:
            nonlocal polls
            polls += 1
            if polls == 2 and slow:
                self._wait()
            return poll()

        return self.inner.generate_interruptible(
            prompts, spec, version=version, poll=stalling_poll, switch=switch, mode=mode
        )

    def take_wait_seconds(self) -> float:
        out, self._wait_s = self._wait_s, 0.0
        return out + self.inner.take_wait_seconds()

    def take_multi_turn_metrics(self, device: torch.device) -> dict[str, float]:
        return self.inner.take_multi_turn_metrics(device)

    def _choose(self, num_prompts: int, seed: int | None) -> list[int]:
        base = seed if seed is not None else self._calls
        slow = slow_prompts(num_prompts, self.tail.prompts, request_seed(base, self.engine.groups.dp_index))
        self.last_slow_prompts = slow
        return slow

    def _wait(self) -> None:
        # A sleep, not work: the latency it stands for (a tool, an environment, a judge) leaves the rank idle.
        t0 = time.perf_counter()
        time.sleep(self.tail.seconds)
        self._wait_s += time.perf_counter() - t0


def install(tail: LatencyTail) -> None:
    """Every Rollout this process's jobs build from now on gets ``tail`` (nothing when it is off)."""
    if tail.enabled:
        wrap_rollouts(lambda rollout: LatencyTailRollout(rollout, tail))


def parse_args(argv: list[str]) -> tuple[LatencyTail, list[str]]:
    """The tail and the rest of ``argv`` (spmdrl.train's arguments, in order)."""
    p = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    p.add_argument("--prompts", type=int, required=True, help="slow prompts per generate call per rank")
    p.add_argument("--seconds", type=float, required=True, help="how late a call with a slow prompt returns")
    known, rest = p.parse_known_args(argv)
    return LatencyTail(known.prompts, known.seconds), rest


def main(argv: list[str] | None = None) -> None:
    from spmdrl import train
    from spmdrl.gc_heap import pause_collection

    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(f"usage: {PROG} --prompts P --seconds S <spmdrl.train's arguments>\n\n{__doc__}")
        sys.exit(0)
    pause_collection()
    tail, rest = parse_args(argv)
    cfg = train.parse_config(rest)
    try:
        tail.check(cfg)
    except ConfigError as e:
        train.exit_config_error(str(e))
    install(tail)
    train.run_entry(cfg)


if __name__ == "__main__":
    main()
