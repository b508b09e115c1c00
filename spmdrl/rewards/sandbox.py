"""Scoring a batch with a reward function so that one bad sample cannot stop or stall the run.

A sample whose function raises, returns something that is not a finite number (in the float32 of
the scores tensor), or whose worker process dies, scores ``error_score`` and counts as an error; one
that runs past ``timeout_s``, or is not done by the batch deadline (``batch_timeout_s``), scores
``error_score`` and counts as a timeout. The first failure of each call is logged with its
traceback. A function that raises :class:`~spmdrl.config.ConfigError` (say ``reward.fn=auto`` on an
unknown data source) ends the run instead: that is a misconfiguration, not a bad sample.

Why user functions run in worker processes (a fresh interpreter per worker, started by ``subprocess``):

- A Python thread cannot be stopped. A hung call left in a thread keeps burning CPU and competing
  for the GIL with the training loop for the rest of the run, and a call that holds the GIL (a
  catastrophically backtracking ``re`` pattern does) blocks the rank outright, so the timeout would
  never fire. A process can be killed (SIGKILL) at the deadline, whatever it is doing.
- A process also contains crashes (a segfaulting extension, ``os._exit``, runaway memory) and
  global-state changes (``os.chdir``, monkey-patching) that would otherwise hit the trainer.
- The worker is a new interpreter (fork + exec, as ``subprocess`` does it). ``fork`` alone would
  copy a rank that holds CUDA contexts, NCCL communicators and vLLM's threads, and a forked child
  of a multi-threaded process may deadlock on a lock another thread held at the fork.
  ``multiprocessing``'s ``spawn`` execs too, but re-imports the launching module (the recipe, torch,
  vLLM) in every worker; our worker imports only :mod:`spmdrl.rewards.sandbox_worker` and the reward
  function.

What a worker is confined by (none of it is a security boundary; see docs/rewards.md):

- Its own session, hence its own process group: ``os.killpg(os.getpgrp(), ...)`` in user code
  reaches the worker, not the trainer, and a timeout kills the whole group, so subprocesses the
  function started die with it (unless they left the group themselves).
- ``RLIMIT_AS`` (``memory_mb``) and ``RLIMIT_FSIZE`` (``file_size_mb``), set before the function is
  unpickled (so before its module is imported): a runaway allocation raises ``MemoryError`` and a
  runaway write ``OSError`` in user code, both scored errors.
- The environment of this process minus the trainer's rendezvous (``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_*``), so a reward that initializes torch.distributed cannot join the training job.

Parallelism and deadlines: samples are handed to ``num_workers`` workers as they come free, so a
function that hangs on every sample costs about ``ceil(N / num_workers)`` times ``timeout_s`` (plus
a worker restart each), and never more than ``batch_timeout_s``: at that deadline the samples still
running or waiting time out and the running workers are killed. Killed or dead workers are replaced
when a sample needs one (in this call, or lazily in the next).

The cost: each worker starts once (well under a second plus the reward module's imports) and then
stays; each call ships the inputs over a pipe. Functions are sent by pickle: module-level functions
and :class:`~spmdrl.rewards.registry.RewardFn` (which pickles as its spec) work; lambdas and
closures do not, and are refused with a clear error. The built-in rule rewards are bounded (they
search at most 300 characters), so ``trusted`` functions run inline on the fast path: exceptions are
still caught, but no timeout (per sample or per batch) and no resource limit is enforced.

This module scores a batch and accounts for its failures; a call and the worker process that makes it
are :mod:`spmdrl.rewards.sandbox_worker`, the pool of workers :mod:`spmdrl.rewards.sandbox_pool`.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spmdrl.errors import ConfigError
from spmdrl.rewards.registry import (
    REWARD_FNS,
    RewardFn,
    RewardInput,
    auto_score,
    load_reward_fn,
    rule_for,
)
from spmdrl.rewards.sandbox_pool import POOL_LOCK, Job, shared_pool
from spmdrl.rewards.sandbox_worker import EXPECTED, Limits, Outcome, call_one, describe

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class RewardResult:
    """A batch's rewards and the samples that got no score. Each sample counts once in ``num_errors`` +
    ``num_timeouts`` (reward/errors, the budget of reward.max_error_frac), whatever failed on it;
    the judge's and the reward model's parts are broken out so that the stop names the source to fix."""

    scores_B: torch.Tensor  # float32, one score per input; error_score where a call failed
    # Raised, returned a bad value, or its worker died (timeouts not included); with the judge
    # (spmdrl/rl/model_rewards.py), also the samples reward.fn scored but whose judge reply did not parse,
    # and with the reward model, those it alone gave a NaN/inf score.
    num_errors: int
    num_timeouts: int  # ran past timeout_s, or not done by the batch deadline
    # Extra numeric keys returned in a dict: one value per input, NaN where the sample has none.
    extra: dict[str, list[float]] = field(default_factory=dict)
    # Which samples reward.fn gave no score (bool, per input); None where only the counts are known
    # (rows kept by dynamic sampling, rows rebuilt on a trainer rank). The judge reads it so that a
    # sample failed by both is counted once.
    failed_B: torch.Tensor | None = None
    # Judge replies that did not parse (reward_model.judge.*), one per sample judged.
    num_judge_errors: int = 0
    # Of those, the ones on samples reward.fn scored: the part of num_errors the judge alone caused.
    num_judge_only: int = 0
    # Reward-model scores that were NaN or inf (reward_model.*), one per sample scored.
    num_rm_nonfinite: int = 0
    # Of those, the ones on samples that reward.fn scored and the judge did not fail: the part of
    # num_errors the reward model alone caused.
    num_rm_only: int = 0
    # Of num_errors, the samples whose multi-turn environment failed (raised, hung or rewrote the
    # conversation: spmdrl.rl.samples.charge_env_failures), scored error_score whatever the rubric said.
    num_env_errors: int = 0

    @property
    def num_fn_failed(self) -> int:
        """The samples reward.fn gave no score (errors and timeouts)."""
        return self.num_errors + self.num_timeouts - self.num_judge_only - self.num_rm_only


def score_batch(
    fn: Callable[..., Any],
    inputs: Sequence[RewardInput],
    *,
    timeout_s: float,
    error_score: float,
    trusted: bool | None = None,
    num_workers: int = 2,
    batch_timeout_s: float | None = None,
    memory_mb: int = 4096,
    file_size_mb: int = 64,
) -> RewardResult:
    """Score every input with ``fn`` (the reward signature of :mod:`spmdrl.rewards.registry`).

    ``trusted``: run inline in this process (no timeout, no limits). None: True for a built-in
    :class:`RewardFn` loaded by name, False otherwise. Untrusted functions run in up to
    ``num_workers`` worker processes kept for the life of this process; each call gets ``timeout_s``
    seconds from the moment its worker receives it, and the whole batch ``batch_timeout_s`` seconds
    from now (None: no batch deadline). ``memory_mb`` and ``file_size_mb`` limit each worker's
    address space and file writes (0: unlimited). Not re-entrant across threads (a lock serializes).
    """
    _check_args(timeout_s, batch_timeout_s, num_workers, memory_mb, file_size_mb)
    deadline = math.inf if batch_timeout_s is None else time.monotonic() + batch_timeout_s
    name = describe(fn)
    if trusted is None:
        trusted = isinstance(fn, RewardFn) and fn.trusted
    # What scores each sample: fn; or, for a trusted fn that dispatches (reward.fn=auto), the rule of the
    # sample's data source when that rule is not trusted (math-verify): those samples go to the workers.
    rules = {ds: _untrusted_rule(fn, ds) for ds in {inp.data_source for inp in inputs}} if trusted else {}
    runs: list[Callable[..., Any]] = [rules.get(inp.data_source) or fn for inp in inputs]
    outcomes: list[Outcome | None] = [
        call_one(fn, name, i, inp) if trusted and run is fn else None
        for i, (inp, run) in enumerate(zip(inputs, runs, strict=True))
    ]
    for run in dict.fromkeys(r for r, o in zip(runs, outcomes, strict=True) if o is None):
        run_name = describe(run)
        job = Job(
            blob=_pickle_fn(run, run_name),
            name=run_name,
            inputs=list(inputs),
            timeout_s=timeout_s,
            batch_timeout_s=batch_timeout_s,
            deadline=deadline,
            limits=Limits(memory_mb, file_size_mb),
            indices=[
                i for i, (r, o) in enumerate(zip(runs, outcomes, strict=True)) if o is None and r == run
            ],
        )
        with POOL_LOCK:
            scored = shared_pool().run(job, num_workers)
        for i in job.indices:
            outcomes[i] = scored[i]
    return _collect(outcomes, name, error_score, timeout_s, batch_timeout_s)  # type: ignore[arg-type]


def _untrusted_rule(fn: Callable[..., Any], data_source: str) -> RewardFn | None:
    """For reward.fn=auto: the rule of ``data_source`` if it is registered untrusted (it then runs in a
    worker, not inline with auto), else None."""
    if not (isinstance(fn, RewardFn) and fn.fn is auto_score):
        return None
    rule = rule_for(data_source)
    for name in REWARD_FNS:
        if REWARD_FNS[name] is rule and not REWARD_FNS.get(name).trusted:
            return load_reward_fn(name)
    return None


def _check_args(
    timeout_s: float, batch_timeout_s: float | None, num_workers: int, memory_mb: int, file_size_mb: int
) -> None:
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if batch_timeout_s is not None and batch_timeout_s <= 0:
        raise ValueError(f"batch_timeout_s must be > 0 (or None: no batch deadline), got {batch_timeout_s}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if memory_mb < 0 or file_size_mb < 0:
        raise ValueError(
            f"memory_mb and file_size_mb must be >= 0 (0: unlimited), got {memory_mb}, {file_size_mb}"
        )


def _pickle_fn(fn: Callable[..., Any], name: str) -> bytes:
    try:
        return pickle.dumps(fn)
    except Exception as e:
        raise ConfigError(
            f"reward function {name} cannot be sent to a worker process ({type(e).__name__}: {e}); "
            "define it at module level in an importable module or a .py file and load it with "
            "load_reward_fn('my_pkg.my_mod:score' or 'path/to/file.py:score')"
        ) from e


def _fit_dtype(outcomes: list[Outcome], name: str, dtype: torch.dtype) -> list[Outcome]:
    """Scores finite as Python floats but not in ``dtype`` (1e39 in float32) are errors too."""
    import torch

    scores = torch.tensor([0.0 if o.score is None else o.score for o in outcomes], dtype=dtype)
    fits = torch.isfinite(scores).tolist()
    return [
        o
        if ok
        else Outcome(
            None,
            error=f"reward function {name} returned {o.score!r} for sample {i}, not finite as {dtype}; {EXPECTED}",
        )
        for i, (o, ok) in enumerate(zip(outcomes, fits, strict=True))
    ]


def _collect(
    outcomes: list[Outcome], name: str, error_score: float, timeout_s: float, batch_timeout_s: float | None
) -> RewardResult:
    import torch  # here, not at the top: worker processes import this module and need no torch

    outcomes = _fit_dtype(outcomes, name, torch.float32)
    failed = [(i, o) for i, o in enumerate(outcomes) if o.score is None]
    num_timeouts = sum(o.timed_out for _, o in failed)
    num_errors = len(failed) - num_timeouts
    if failed:
        first_index, first = failed[0]
        log.warning(
            "reward function %s: %d of %d samples failed (%d errors, %d timeouts; timeout_s=%.3g, "
            "batch_timeout_s=%s), scored %s; first failure (sample %d):\n%s",
            name,
            len(failed),
            len(outcomes),
            num_errors,
            num_timeouts,
            timeout_s,
            batch_timeout_s,
            error_score,
            first_index,
            first.error,
        )
    keys = sorted({k for o in outcomes for k in o.extra})
    extra = {k: [o.extra.get(k, math.nan) for o in outcomes] for k in keys}
    scores = [error_score if o.score is None else o.score for o in outcomes]
    return RewardResult(
        scores_B=torch.tensor(scores, dtype=torch.float32),
        num_errors=num_errors,
        num_timeouts=num_timeouts,
        extra=extra,
        failed_B=torch.tensor([o.score is None for o in outcomes], dtype=torch.bool),
    )
