"""``logging.profile_steps``: chosen training steps run under ``torch.profiler`` on every rank.

The benchmarks profile one pass on a synthetic batch (benchmarks/update_profile.py); this profiles the
run itself, with its data, lengths, engine and collectives, where a slow step actually happens. The RL
recipes trace the whole step (generation, passes, update, sync, logging); sft and rm their forward,
backward and optimizer step (an RL job's SFT warm-start traces none: the listed steps are RL steps).
Each chosen step writes, under ``<output_dir>/profile/step-<N>/``:

- ``rank-<R>.json.gz``: the Chrome trace, gzipped (Perfetto opens it as it is): host ops, and on CUDA
  the kernels and copies on their streams, so idle gaps and host-bound stretches show (grpo_tiny's
  step: 15 MB a rank unzipped, about 1 MB zipped);
- ``rank-<R>.txt``: first the step's phases (spmdrl.logging.timer.PhaseTimer's ``phase/<name>``
  ranges, the timing/* metrics' names): host milliseconds, and on CUDA the device's kernel milliseconds
  inside each and their ratio, which says at a glance whether a phase is host-bound (a ratio well
  under 1: the GPU waits for the host); then the ops with the most self time (device time on CUDA, host
  time otherwise). Rank 0 also logs both.

Only the chosen steps pay the profiler's overhead, and their ``timing/*`` metrics carry it. Files are
written under a temporary name and renamed, so a step that fails leaves no half-written trace.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from spmdrl.errors import ConfigError
from spmdrl.logging.timer import PHASE_PREFIX

log = logging.getLogger(__name__)

# Rows of the op table written beside each trace (and logged by rank 0).
TABLE_ROWS = 25


def check_profile_steps(steps: Sequence[int], total_steps: int) -> None:
    """Each chosen step must be one the run takes (1 .. total_steps): a step it never reaches is a typo
    that would otherwise profile nothing, found out only at the end."""
    bad = sorted({s for s in steps if not 1 <= s <= total_steps})
    if bad:
        raise ConfigError(
            f"logging.profile_steps={list(steps)}: step(s) {bad} outside this run's steps 1..{total_steps} "
            "(steps count from 1, as logged); pick steps the run takes, e.g. logging.profile_steps=[3]"
        )


def phase_table(events: Any, cuda: bool) -> str:
    """The step's phases (``phase/<name>`` ranges) from ``prof.events()``, in the order of their host
    time: calls, host ms, and on CUDA the device ms of the kernels launched inside and device / host.
    From the host-side ranges only: on CUDA the profiler also records each range's span on the GPU's
    timeline under the same name, which counts idle time as busy (key_averages would merge the two)."""
    totals: dict[str, list[float]] = {}  # name -> [calls, host us, device us]
    for e in events:
        if e.name.startswith(PHASE_PREFIX) and e.device_type == DeviceType.CPU:
            t = totals.setdefault(e.name.removeprefix(PHASE_PREFIX), [0, 0.0, 0.0])
            t[0] += 1
            t[1] += e.time_range.elapsed_us()
            t[2] += e.device_time_total if cuda else 0.0
    if not totals:
        return "phases: none (no PhaseTimer range ran in this step)"
    head = f"{'phase':<32}{'calls':>7}{'host ms':>12}"
    head += f"{'device ms':>12}{'device/host':>13}" if cuda else ""
    lines = ["phases (spmdrl.logging.timer ranges; nested phases count in their parents too)", head]
    for name, (calls, host_us, device_us) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        line = f"{name:<32}{int(calls):>7}{host_us / 1e3:>12.1f}"
        if cuda:
            line += f"{device_us / 1e3:>12.1f}{device_us / host_us if host_us else 0.0:>13.2f}"
        lines.append(line)
    return "\n".join(lines)


def profile_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "profile" / f"step-{step}"


@contextlib.contextmanager
def profile_step(
    steps: Sequence[int], output_dir: Path, step: int, rank: int, device: torch.device
) -> Iterator[None]:
    """Runs the body under torch.profiler if ``step`` is one of ``steps``, and writes what it saw."""
    if step not in steps:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
        if cuda:  # the step's last kernels belong in its trace
            torch.cuda.synchronize(device)
    out = profile_dir(output_dir, step)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"rank-{rank}.json.gz"
    tmp = out / f".rank-{rank}.tmp.json.gz"  # torch gzips a path ending in .gz
    prof.export_chrome_trace(str(tmp))
    tmp.replace(trace)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = phase_table(prof.events(), cuda) + "\n\n"
    table += prof.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS)
    tmp = out / f".rank-{rank}.txt.tmp"
    tmp.write_text(table)
    tmp.replace(out / f"rank-{rank}.txt")
    if rank == 0:
        log.info("profile of step %d: %s (every rank's in %s)\n%s", step, trace.name, out, table)
