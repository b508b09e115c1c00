"""Asynchronous GRPO's throughput and policy age against its synchronous run, with and without a latency tail.

    python benchmarks/async_step.py                                  # CPU: grpo_async_tiny on 4 processes
    python benchmarks/async_step.py --json async_step.json
    python benchmarks/async_step.py --nproc 8 --set model.path=/path/to/hf    # one 8-GPU node, unchanged
    python benchmarks/async_step.py --staleness 0,1 --tail-prompts 4 --tail-seconds 5 --steps 12

For each trainer.max_staleness k of ``--staleness`` (default 0,1,2), without and with a simulated latency
tail (``--tail``: ``--tail-prompts`` of each rollout rank's prompts per generate call are slow, the call
returns ``--tail-seconds`` late; docs/rollout.md#simulated-latency-tail), the script runs the real recipe as
a subprocess, the tail's jobs through the tail's launcher (spmdrl.testing.latency_tail, which wraps the
job's Rollout and runs spmdrl.train's main),

    torchrun --nproc_per_node=<nproc> -m spmdrl.train recipe=<recipe> trainer.max_staleness=<k>
        trainer.total_steps=<steps> ...
    torchrun --nproc_per_node=<nproc> -m spmdrl.testing.latency_tail --prompts <p> --seconds <s>
        recipe=<recipe> trainer.max_staleness=<k> trainer.total_steps=<steps> ...

(``--set KEY=VALUE``, repeatable, is appended to every job's overrides, so it wins), one job after the
other, and reads its metrics.jsonl back. Every job trains the same number of steps of the same batch:
equal samples.

Steps/hour come from ``timing/step_s``, each step's wall time as the recipe measures it (start to end
of the step on the logging rank), x 3600; start-up before step 1 (vLLM, the warm-start, validation at
step 0) and validation and checkpoints are not in it. Two windows:

- ``run/h``: every step, 1 to ``--steps``: how fast the job finishes its steps at equal samples. For
  k >= 1 it holds the pipeline's fill (step 1 waits for the k batches generated before the first
  update) and drain (the last k steps, whose batches were generated ahead, wait for no generation);
  step 1's one-off costs (first calls' compilation and caches) are in every row alike.
- ``steady/h``: the steps after ``--warmup`` (default 1) and before the drain (steps warmup+1 to
  ``--steps`` - k): the rate the pipeline holds once full, without either end. ``--steps`` must leave
  at least one such step for the largest k.
- ``x k=0``: each over the k=0 job's with the same tail setting, measured in the same run (above 1,
  faster than the synchronous loop on the same split of ranks).
- ``step_s``, ``rollout_s``, ``tail_s``, policy age: over the steady steps. ``rollout_s``: the mean
  ``timing/rollout_s`` (generation, the tail's wait included); ``tail_s``: the mean ``rollout/wait_s``
  (what the generating ranks' Rollout waited: the tail's) where the recipe logs it; ``age_mean`` /
  ``age_max``: the mean ``async/policy_age_mean`` and the largest ``async/policy_age_max`` (versions
  between the policy that generated a row and the one trained).
- ``val_acc``: the last ``val/accuracy`` logged (trainer.val_every; validation is not in the steps' time).

A value the recipe does not log (a synchronous recipe has no ``async/*``) shows as ``-``; any recipe runs
(``--recipe grpo_tiny --staleness 0``, say). Nothing here is CPU-specific: on GPUs the same command with
``--nproc`` and a model. Each job's config is composed before anything runs, so a misspelled key fails at
once; a job that fails is left out of the table (its log's tail is printed) and the script exits 1.

``--json``: figures ``async_step/k<k>[_tail]/<figure>``: ``steps_per_hour`` (run/h) and
``steady_steps_per_hour`` with the k=0 job of the same tail setting as baseline; ``step_s``, ``rollout_s``,
``tail_s``, ``policy_age_mean``, ``policy_age_max``, ``val_accuracy`` (those logged) without one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_process import run_logged
from bench_report import Figure, fmt_ratio, write_json

# Where the script reads each job's metrics from: set by the script, never by --set.
OUTPUT_KEY = "trainer.output_dir"


@dataclass(frozen=True)
class Job:
    """One run of the recipe: its staleness and whether the latency tail is on."""

    k: int
    tail: bool

    @property
    def name(self) -> str:
        return f"k{self.k}_tail" if self.tail else f"k{self.k}"


@dataclass(frozen=True)
class Result:
    """What one job's metrics.jsonl says (None: the recipe does not log it)."""

    job: Job
    steps: int  # steps with a step time (every step: trainer.log_every=1)
    steps_per_hour: float  # over all of them
    steady_steps: int  # after the warm-up and before the drain
    steady_steps_per_hour: float | None
    step_s: float  # the mean timing/step_s of the steady steps (all, when there are none)
    rollout_s: float | None
    tail_s: float | None
    policy_age_mean: float | None
    policy_age_max: float | None
    val_accuracy: float | None
    job_wall_s: float | None = None


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="grpo_async_tiny")
    p.add_argument("--nproc", type=int, default=4, help="processes per job (torchrun --nproc_per_node)")
    p.add_argument("--steps", type=int, default=10, help="trainer.total_steps of every job")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of steps/hour")
    p.add_argument("--staleness", default="0,1,2", help="trainer.max_staleness values, comma-separated")
    p.add_argument(
        "--tail", default="both", choices=("both", "off", "on"), help="jobs without / with the tail"
    )
    p.add_argument("--tail-prompts", type=int, default=2, help="slow prompts per generate call per rank")
    p.add_argument(
        "--tail-seconds", type=float, default=2.0, help="how late a call with a slow prompt returns"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every job"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--log-dir", default="", help="keep each job's log here (<name>.log)")
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    try:
        a.staleness = sorted({int(k) for k in a.staleness.split(",") if k.strip()})
    except ValueError:
        p.error(f"--staleness: expected integers like 0,1,2, got {a.staleness!r}")
    if not a.staleness or min(a.staleness) < 0:
        p.error("--staleness: at least one value, each >= 0")
    if a.warmup < 0 or a.steps <= a.warmup + max(a.staleness, default=0):
        p.error(
            f"--steps ({a.steps}) must be more than --warmup ({a.warmup}, >= 0) + the largest staleness: "
            "the steady window is the steps after the warm-up and before the last k"
        )
    if a.tail != "off" and (a.tail_prompts <= 0 or a.tail_seconds <= 0):
        p.error("--tail on/both needs --tail-prompts and --tail-seconds > 0 (or --tail off)")
    for o in a.set:
        if "=" not in o:
            p.error(f"--set {o!r}: expected KEY=VALUE")
        if o.lstrip("+~").split("=", 1)[0].strip() == OUTPUT_KEY:
            p.error(f"--set: {OUTPUT_KEY} is set by the script")
    return a


def jobs(a: argparse.Namespace) -> list[Job]:
    """Without the tail first, then with it; k ascending within each, so k=0 comes before its ratios."""
    tails = {"both": (False, True), "off": (False,), "on": (True,)}[a.tail]
    return [Job(k, tail) for tail in tails for k in a.staleness]


def overrides(a: argparse.Namespace, job: Job, out_dir: Path) -> list[str]:
    """The job's command-line overrides: the measured settings, then --set (appended, so it wins)."""
    return [
        f"recipe={a.recipe}",
        f"trainer.max_staleness={job.k}",
        f"trainer.total_steps={a.steps}",
        "trainer.log_every=1",  # a row per step
        "trainer.save_every=0",  # no checkpoint inside the measured steps (one after the last)
        "logging.backends=[]",
        "logging.progress_bar=false",
        *a.set,
        f"{OUTPUT_KEY}={out_dir}",
    ]


def launcher(a: argparse.Namespace, job: Job) -> list[str]:
    """What torchrun runs: spmdrl.train, or for a tail job the tail's launcher with its settings."""
    if not job.tail:
        return ["-m", "spmdrl.train"]
    tail = ["--prompts", str(a.tail_prompts), "--seconds", str(a.tail_seconds)]
    return ["-m", "spmdrl.testing.latency_tail", *tail]


def check_configs(a: argparse.Namespace) -> None:
    """Every job's overrides compose into a valid config (and the tail fits it) before the first job's
    minutes."""
    from spmdrl.config_loader import load_config
    from spmdrl.errors import ConfigError
    from spmdrl.testing.latency_tail import LatencyTail

    for job in jobs(a):
        try:
            cfg = load_config(overrides(a, job, Path("out")))
            if job.tail:
                LatencyTail(a.tail_prompts, a.tail_seconds).check(cfg)
        except ConfigError as e:
            raise SystemExit(f"the {job.name} job's config: {e}") from None


# ------------------------------------------------------------------------------------------ reading
def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _per_hour(rows: list[dict]) -> float:
    return 3600.0 * len(rows) / sum(float(r["timing/step_s"]) for r in rows)


def read_result(job: Job, metrics_path: Path, warmup: int) -> Result:
    """One job's figures from its metrics.jsonl: every step's row with a step time, and the steady ones
    (after step ``warmup``, before the last ``job.k``)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    timed = [r for r in rows if r["step"] >= 1 and "timing/step_s" in r]
    if not timed:
        raise ValueError(f"{metrics_path}: no step row with timing/step_s")
    last = max(r["step"] for r in timed)
    steady = [r for r in timed if warmup < r["step"] <= last - job.k]
    measured = steady or timed

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in measured if key in r]

    ages_max = values("async/policy_age_max")
    val = [float(r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    return Result(
        job=job,
        steps=len(timed),
        steps_per_hour=_per_hour(timed),
        steady_steps=len(steady),
        steady_steps_per_hour=_per_hour(steady) if steady else None,
        step_s=statistics.fmean(values("timing/step_s")),
        rollout_s=_mean(values("timing/rollout_s")),
        tail_s=_mean(values("rollout/wait_s")),
        policy_age_mean=_mean(values("async/policy_age_mean")),
        policy_age_max=max(ages_max) if ages_max else None,
        val_accuracy=val[-1] if val else None,
    )


def k0_figure(r: Result, results: list[Result], key: str = "steps_per_hour") -> float | None:
    """Figure ``key`` of the k=0 job with ``r``'s tail setting (None: no such job ran)."""
    base = next((b for b in results if b.job.k == 0 and b.job.tail == r.job.tail), None)
    return getattr(base, key) if base else None


def speedup(r: Result, results: list[Result], key: str = "steps_per_hour") -> float | None:
    """``r``'s steps/hour (``key``) over the k=0 job's with the same tail setting (None: no such job ran,
    or a figure is missing)."""
    value = getattr(r, key)
    return None if value is None else Figure("", value, "", k0_figure(r, results, key)).ratio


# ------------------------------------------------------------------------------------------- report
def _cell(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


COLUMNS = (
    "k",
    "tail",
    "run/h",
    "x k=0",
    "steady/h",
    "x k=0",
    "step_s",
    "rollout_s",
    "tail_s",
    "age_mean",
    "age_max",
    "val_acc",
)


def table(results: list[Result], tail_note: str) -> str:
    """The results as a text table, one row per job, ratios against k=0 of the same tail setting."""
    lines = [" ".join(f"{c:>9}" for c in COLUMNS)]
    for r in results:
        cells = (
            str(r.job.k),
            tail_note if r.job.tail else "off",
            _cell(r.steps_per_hour, ".0f"),
            fmt_ratio(speedup(r, results)),
            _cell(r.steady_steps_per_hour, ".0f"),
            fmt_ratio(speedup(r, results, "steady_steps_per_hour")),
            _cell(r.step_s, ".3f"),
            _cell(r.rollout_s, ".3f"),
            _cell(r.tail_s, ".2f"),
            _cell(r.policy_age_mean, ".2f"),
            _cell(r.policy_age_max, ".0f"),
            _cell(r.val_accuracy, ".3f"),
        )
        lines.append(" ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


# The figures besides steps/hour and step_s, each where the recipe logs it.
FIGURE_UNITS = {
    "rollout_s": "s",
    "tail_s": "s",
    "policy_age_mean": "versions",
    "policy_age_max": "versions",
    "val_accuracy": "",
}


def figures(results: list[Result]) -> list[Figure]:
    out: list[Figure] = []
    for r in results:
        prefix = f"async_step/{r.job.name}/"
        for key in ("steps_per_hour", "steady_steps_per_hour"):
            value = getattr(r, key)
            if value is not None:
                out.append(Figure(prefix + key, value, "steps/h", k0_figure(r, results, key)))
        out.append(Figure(prefix + "step_s", r.step_s, "s"))
        for key, unit in FIGURE_UNITS.items():
            value = getattr(r, key)
            if value is not None:
                out.append(Figure(prefix + key, value, unit))
    return out


# -------------------------------------------------------------------------------------------- jobs
class JobFailed(Exception):
    """A job that exited with an error or ran out of time; the message ends with its log's tail."""


def run_job(a: argparse.Namespace, job: Job, work: Path) -> Result:
    out_dir = work / f"{job.name}-run"
    args = overrides(a, job, out_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}"]
    cmd += [*launcher(a, job), *args]
    shown = " ".join([*launcher(a, job), *(o for o in args if not o.startswith(OUTPUT_KEY))])
    print(f"{job.name}: torchrun --nproc_per_node={a.nproc} {shown}", flush=True)
    log_path = work / f"{job.name}.log"
    t0 = time.perf_counter()
    code = run_logged(cmd, log_path, a.timeout)
    wall = time.perf_counter() - t0
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log_path, Path(a.log_dir) / log_path.name)
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        why = f"ran past --timeout {a.timeout:.0f} s" if code is None else f"failed (exit {code})"
        raise JobFailed(f"the {job.name} job {why}; its last lines:\n{tail}")
    return dataclasses.replace(read_result(job, out_dir / "metrics.jsonl", a.warmup), job_wall_s=wall)


def save_json(a: argparse.Namespace, results: list[Result], failed: list[str]) -> None:
    write_json(
        a.json,
        "async_step",
        figures(results),
        recipe=a.recipe,
        nproc=a.nproc,
        steps=a.steps,
        warmup=a.warmup,
        staleness=a.staleness,
        tail_prompts=a.tail_prompts,
        tail_seconds=a.tail_seconds,
        overrides=list(a.set),
        job_wall_s={r.job.name: r.job_wall_s for r in results},
        failed_jobs=failed,
    )


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    check_configs(a)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    results: list[Result] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="spmdrl-async-step-") as tmp:
        for job in jobs(a):
            try:
                r = run_job(a, job, Path(tmp))
            except (JobFailed, ValueError) as e:
                print(e, flush=True)
                failed.append(job.name)
                continue
            results.append(r)
            print(
                f"{job.name}: {r.steps_per_hour:.0f} steps/h over the run, job wall {r.job_wall_s:.0f} s",
                flush=True,
            )
            if a.json:  # the figures so far, in case a later job never ends
                save_json(a, results, failed)
    tail_note = f"{a.tail_prompts}x{a.tail_seconds:g}s"
    print(
        f"\n{a.recipe} on {a.nproc} processes, {a.steps} steps each (run/h: steps 1-{a.steps}; steady/h: "
        f"steps {a.warmup + 1}-({a.steps} - k)); "
        f"tail: {a.tail_prompts} slow prompt(s) per generate call per rank, +{a.tail_seconds:g} s; "
        "x k=0: against k=0 with the same tail"
    )
    print(table(results, tail_note))
    if failed:
        print(f"failed job(s), left out: {', '.join(failed)} (their logs' tails are above)")
    if a.json:
        save_json(a, results, failed)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
