"""An RL step's metrics: step_metrics reduces the rollout, reward, timing and peak-memory figures over all
ranks, and the trainer-vs-engine logprob mismatch and the training speed over the actor's ranks. PHASES
names every phase a step may time (its ``timing/<phase>_s`` keys); peak_memory_gb gives
``perf/max_memory_gb``. The keys are described in docs/metrics.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from spmdrl.distributed.reduce import all_reduce_max, all_reduce_sum
from spmdrl.logging.timer import PhaseTimer
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.samples import ScoredSamples
from spmdrl.rollout.mismatch import logprob_mismatch

# Every phase a step may time. Ranks report the same keys (0 where a phase did not run on them: under a
# split placement the actor's and the critic's ranks run different phases).
PHASES = (
    "rollout",
    "reward",
    "engine_sleep",
    "experience",
    "exchange",
    "old_ref",
    "values",
    "critic_update",
    "actor_update",
    "update",
    "weight_sync",
    "weight_sync_wake",
    "weight_sync_load",
    "weight_sync_prefix_reset",
    "weight_sync_check",
)


def host_peak_memory_gb() -> float:
    """This process's peak resident set since it started, in GiB.

    VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec,
    so a rank started by a large launcher would report the launcher's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """This rank's peak memory since it started, in GiB: ``memory_gb`` is the CUDA allocator's peak on a
    GPU, the process's peak resident set on CPU (model, optimizer, engine and its KV cache together); on a
    GPU ``host_memory_gb`` is the resident set too (where offloaded state goes)."""
    if device.type == "cuda":
        return {
            "memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "host_memory_gb": host_peak_memory_gb(),
        }
    return {"memory_gb": host_peak_memory_gb()}


def reward_extra_metrics(
    extra: dict[str, list[float]], device: torch.device, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """``reward/extra/<key>``: the mean over all ranks' samples of each numeric key the reward function
    returned in its dict besides "score" (NaN, where a sample had no such key, is left out). Every rank must
    call it: the keys are gathered first, since a rank whose samples never returned a key has none."""
    gathered: list[list[str]] = [sorted(extra)]
    if dist.is_initialized():
        gathered = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(gathered, sorted(extra), group=group)
    keys = sorted(set().union(*gathered))
    sums: dict[str, float] = {}
    for k in keys:
        values = [v for v in extra.get(k, []) if not math.isnan(v)]
        sums[f"sum/{k}"], sums[f"n/{k}"] = sum(values), len(values)
    total = all_reduce_sum(sums, device, group)
    return {f"reward/extra/{k}": total[f"sum/{k}"] / total[f"n/{k}"] for k in keys if total[f"n/{k}"] > 0}


def step_metrics(
    samples_per_prompt: int,
    ppo_epochs: int,
    samples: ScoredSamples,
    timer: PhaseTimer,
    device: torch.device,
    actor_part: tuple[PolicyBatch, torch.Tensor, torch.Tensor] | None,
    actor_group: dist.ProcessGroup | None = None,
    resident_gb: float | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Rollout, reward and timing metrics of the step reduced over all ranks, and, on the actor's ranks
    (``actor_part``: its batch, the sampled mask and the old logprobs), the trainer-vs-engine mismatch
    and training speed reduced over the actor's group.

    The mismatch is measured on every sampled token (the sampled mask, before rejection masked any).
    ``group``: the ranks that hold the step's samples, over which the rest is reduced (default: every
    rank; parallel.placement=async: the trainer ranks, which received them). ``samples_per_prompt``:
    rollout.n; ``ppo_epochs``: algorithm.ppo_epochs, the passes the update made over the actor's tokens.
    """
    n, gens, scores_B = samples_per_prompt, samples.gens, samples.scores_B
    sums = all_reduce_sum(
        {
            "reward": float(scores_B.sum()),
            "reward_sq": float((scores_B**2).sum()),
            "n": len(gens),
            "tokens": sum(len(g.token_ids) for g in gens),
            "truncated": sum(g.finish_reason == "length" for g in gens),
            "errors": samples.rewards.num_errors,
            "timeouts": samples.rewards.num_timeouts,
            "solved_groups": float((scores_B.view(-1, n).min(dim=1).values >= 1.0).sum()),
        },
        device,
        group,
    )
    # A step is as slow as its slowest rank; phases no rank ran are left out.
    seconds = {f"{p}_s": timer.seconds.get(f"{p}_s", 0.0) for p in PHASES}
    resident = {} if resident_gb is None else {"resident_gb": resident_gb}
    peaks = all_reduce_max({**seconds, **peak_memory_gb(device), **resident}, device, group)
    memory_gb = peaks.pop("memory_gb")
    host_memory_gb = peaks.pop("host_memory_gb", None)
    resident_gb = peaks.pop("resident_gb", None)
    slowest = {k: v for k, v in peaks.items() if v > 0}
    count = sums["n"]
    mean = sums["reward"] / count
    metrics = {
        "rollout/reward_mean": mean,
        "rollout/reward_std": math.sqrt(max(sums["reward_sq"] / count - mean**2, 0.0)),
        "rollout/response_len_mean": sums["tokens"] / count,
        # Responses cut at data.max_response_length (verl: response_length/clip_ratio).
        "rollout/truncated_frac": sums["truncated"] / count,
        "rollout/solved_group_frac": sums["solved_groups"] / (count / n),
        # Every sample that did not get a real score: raised, bad value, or past the timeout.
        "reward/errors": sums["errors"] + sums["timeouts"],
        "reward/timeouts": sums["timeouts"],
        **samples.metrics,
        **reward_extra_metrics(samples.rewards.extra, device, group),
        "perf/rollout_tokens_per_s": sums["tokens"] / max(slowest.get("rollout_s", 0.0), 1e-9),
        # The largest rank's peak so far: resident memory on CPU, the allocator's peak on GPU.
        "perf/max_memory_gb": memory_gb,
        **({} if host_memory_gb is None else {"perf/max_host_memory_gb": host_memory_gb}),
        # What the trainer keeps on the GPU between its passes (the engine asleep): model.offload_* lower it.
        **({} if resident_gb is None else {"perf/update_start_memory_gb": resident_gb}),
        **{f"timing/{k}": v for k, v in slowest.items()},
    }
    if "critic_update_s" in slowest and "actor_update_s" in slowest:
        # 1.0 when the two updates run one after the other (colocated), up to 2.0 fully side by side.
        metrics["perf/update_overlap"] = (slowest["actor_update_s"] + slowest["critic_update_s"]) / max(
            slowest.get("update_s", 0.0), 1e-9
        )
    if actor_part is not None:
        batch, sampled_mask_BT, old_logprobs_BT = actor_part
        mismatch = logprob_mismatch(
            old_logprobs_BT, batch.engine_logprobs_BT, sampled_mask_BT, group=actor_group or dist.group.WORLD
        )
        tokens = float(batch.attention_mask_BT.sum()) * ppo_epochs
        train_tokens = all_reduce_sum({"t": tokens}, device, actor_group)["t"]
        metrics.update(
            {f"mismatch/{k}": mismatch[k] for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k3")}
        )
        metrics["perf/train_tokens_per_s"] = train_tokens / max(slowest.get("actor_update_s", 0.0), 1e-9)
    return metrics
