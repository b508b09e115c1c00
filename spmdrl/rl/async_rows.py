"""A generated batch from the rollout ranks to the trainer ranks (parallel.placement=async).

A rollout rank's scored samples travel as rows (spmdrl.distributed.exchange: point-to-point sends of a
buffer of each field's bytes, no pickling), together with what the trainer needs besides the tokens, one
column per row: the training reward, the policy version that generated the row, the prompt's dataset
index, whether the response was truncated, and what the rollout rank measured (its reward failures on
its first row, its generation and scoring seconds on every row); ReMax's baseline (the reward of the
prompt's greedy answer) where algorithm.adv_estimator=remax; and the extra keys the reward function
returned in its dict (gdpo's components among them), each row naming its own keys (REWARD_EXTRA_NAMES),
so the trainer rebuilds RewardResult.extra as the rollout rank scored it. Metrics the rollout ranks reduced over
their own group for the batch (the reward model's and judge's reward/*, the overlong penalty's, the agent
loop's multi_turn/*, dynamic sampling's rollout/*: CARRIED_METRICS) travel on every row as one more field, NaN where a metric was not measured, and become
the trainer's ScoredSamples.metrics, which rank 0 logs. The trainer ranks rebuild from them the same
PolicyBatch and ScoredSamples a colocated rank builds from its own generation, so the rest of the step
(experience, update, metrics) is GRPO's.

Layouts: the rollout ranks hold their rows in rank order (whole prompt groups each); the trainer ranks
get equal consecutive blocks (whole groups too, checked by check_async_batch). With as many trainer
ranks as rollout ranks, trainer rank j gets exactly rollout rank j's rows, in order: what colocated rank j
of a synchronous run holds.

Each field travels at its own width (spmdrl.distributed.exchange.move_rows with ``width=None``): the rows
as wide as the sending rank's longest, a column one number per row. The widths go ahead in a header on
the same point-to-point pair, so no collective spans the world (one would stall the overlap); the trainer
trims to its rows' longest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmdrl.config import Config
from spmdrl.data.prompts import PromptDataset
from spmdrl.distributed.exchange import RowLayout, move_rows
from spmdrl.distributed.placement import Placement
from spmdrl.errors import ConfigError
from spmdrl.logging.timer import PhaseTimer
from spmdrl.rewards.sandbox import RewardResult
from spmdrl.rl.batch import (
    IMAGE_MASK,
    IMAGE_SHAPE,
    IMAGES,
    ROUTED,
    ROUTED_SHAPE,
    PolicyBatch,
    pack_images,
    pack_routed,
    unpack_images,
    unpack_routed,
)
from spmdrl.rl.experience import policy_batch
from spmdrl.rl.metrics import peak_memory_gb
from spmdrl.rl.model_rewards import ModelRewards
from spmdrl.rl.samples import DynamicSampling, OverlongShaping, ScoredSamples
from spmdrl.rl.staleness import mask_stale
from spmdrl.rollout.engine import Generation
from spmdrl.rollout.rollout import MULTI_TURN_KEYS

# The (B, T) fields of the rows, and the per-row columns sent as (B, 1).
ROW_FIELDS: dict[str, torch.dtype] = {
    "input_ids_BT": torch.long,
    "attention_mask_BT": torch.long,
    "response_mask_BT": torch.bool,
    "engine_logprobs_BT": torch.float32,
    "token_rewards_BT": torch.float32,
}
COLUMNS: dict[str, torch.dtype] = {
    "score": torch.float32,  # the reward trained on (ScoredSamples.scores_B)
    "version": torch.long,  # the policy version that generated the row
    "data_index": torch.long,  # the prompt's index in the training set
    "prompt_len": torch.long,
    "truncated": torch.bool,  # finish_reason == "length"
    "errors": torch.long,  # the rollout rank's reward failures, on its first row (0 elsewhere)
    "timeouts": torch.long,
    "judge_errors": torch.long,  # reward_model.judge: replies that did not parse, on its first row
    "judge_only": torch.long,  # ... of them, on samples reward.fn scored (the judge alone failed them)
    "rm_nonfinite": torch.long,  # reward_model: NaN/inf scores, on its first row
    "rm_only": torch.long,  # ... of them, on samples reward.fn and the judge scored
    "env_errors": torch.long,  # env.source: trajectories its environment failed (of errors), on its first row
    "rollout_s": torch.float64,  # the rollout rank's seconds, on every row
    "reward_s": torch.float64,
    "rollout_wait_s": torch.float64,  # of rollout_s: what its Rollout waited (Rollout.take_wait_seconds)
    "memory_gb": torch.float64,  # the rollout rank's peak memory so far (perf/rollout_max_memory_gb)
    "interrupted": torch.bool,  # rollout.partial: a weight switch landed while it was generating
    "regenerated": torch.bool,  # trainer.stale_policy=regenerate: generated again, the first one too old
    "baseline": torch.float32,  # algorithm.adv_estimator=remax: the prompt's greedy reward; NaN otherwise
}
# Per token, the policy version that sampled it (the row's version everywhere unless rollout.partial
# switched weights mid-generation); aligned with input_ids_BT, the prompt's positions hold the row's.
TOKEN_VERSIONS = "versions_BT"
# The reward function's extra keys (RewardResult.extra) of each row: their values (NaN where a sample had
# none), and their names, "\n"-joined UTF-8 bytes; both as wide as the row's key count / name length (0
# when the reward returns a plain score).
REWARD_EXTRA, REWARD_EXTRA_NAMES = "reward_extra", "reward_extra_names"
# Router replay (model.router_replay=r3): each row's routed experts travel as spmdrl.rl.batch's ROUTED and
# ROUTED_SHAPE fields (pack_routed), one (B, 0) field and (0, 0) without replay. A vision-language model's
# images travel as its IMAGES, IMAGE_MASK and IMAGE_SHAPE fields (pack_images), (B, 0) each for a text model.
# The rollout ranks' reduced metrics of a batch, one per position of the "measured" field: a fixed list, so
# the trainer reads them back without asking which were measured (the absent ones are NaN).
# A queue saved since these names are saved with it reads its columns by name (fill_missing_fields).
CARRIED_METRICS: tuple[str, ...] = (
    *ModelRewards.METRIC_KEYS,
    *OverlongShaping.METRIC_KEYS,
    *MULTI_TURN_KEYS,
    *DynamicSampling.METRIC_KEYS,
)
# What the measured columns were in queues saved without their names, by their count: before the overlong
# penalty travelled, and after; both before multi_turn/observation_images (MULTI_TURN_KEYS' last) did.
_SAVED_MULTI_TURN = MULTI_TURN_KEYS[: MULTI_TURN_KEYS.index("multi_turn/observation_images")]
_UNNAMED_CARRIED: dict[int, tuple[str, ...]] = {
    len(ModelRewards.METRIC_KEYS) + len(_SAVED_MULTI_TURN): (*ModelRewards.METRIC_KEYS, *_SAVED_MULTI_TURN),
    len(ModelRewards.METRIC_KEYS) + len(OverlongShaping.METRIC_KEYS) + len(_SAVED_MULTI_TURN): (
        *ModelRewards.METRIC_KEYS,
        *OverlongShaping.METRIC_KEYS,
        *_SAVED_MULTI_TURN,
    ),
}
SPEC: dict[str, torch.dtype] = {
    **ROW_FIELDS,
    TOKEN_VERSIONS: torch.long,
    **COLUMNS,
    "measured": torch.float64,
    REWARD_EXTRA: torch.float64,
    REWARD_EXTRA_NAMES: torch.long,
    ROUTED: torch.int16,
    ROUTED_SHAPE: torch.long,
    IMAGES: torch.float32,
    IMAGE_MASK: torch.bool,
    IMAGE_SHAPE: torch.long,
}


def check_async_batch(cfg: Config, placement: Placement) -> None:
    """Every rollout rank and every trainer rank must hold whole prompt groups: the global batch must
    split evenly over both (GRPO's group statistics stay on one rank)."""
    g = cfg.trainer.global_batch_size
    rollout, trainer = placement.role("rollout").num_ranks, placement.role("actor").num_ranks
    if g % rollout or g % trainer:
        raise ConfigError(
            f"trainer.global_batch_size={g} prompts must split into whole prompt groups over the {rollout} "
            f"rollout ranks and over the {trainer} trainer ranks (parallel.placement=async, "
            f"parallel.rollout_ranks={cfg.parallel.rollout_ranks}); pick a multiple of both"
        )
    if rollout % cfg.rollout.tp:
        raise ConfigError(
            f"rollout.tp={cfg.rollout.tp} must divide the {rollout} rollout ranks (parallel.placement=async): "
            "each engine spans tp consecutive rollout ranks"
        )


@dataclass(frozen=True)
class BatchLayout:
    """Where a step's rows are: as generated on the rollout ranks, and as trained on the trainer ranks."""

    rollout: RowLayout
    trainer: RowLayout

    @classmethod
    def plan(cls, placement: Placement, rows_per_rollout_rank: int) -> BatchLayout:
        ranks = placement.role("rollout").ranks
        total = rows_per_rollout_rank * len(ranks)
        return cls(
            RowLayout.from_counts([rows_per_rollout_rank] * len(ranks), ranks),
            RowLayout.contiguous(total, placement.role("actor").ranks),
        )


def pack_samples(
    samples: ScoredSamples,
    version: int,
    seconds: dict[str, float],
    pad_id: int,
    device: torch.device,
    measured: Mapping[str, float] | None = None,
    token_versions: list[list[int]] | None = None,
    interrupted: list[bool] | None = None,
    regenerated: bool = False,
    baseline_B: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """A rollout rank's scored samples as the rows and columns it sends; ``measured``: metrics already
    reduced over the rollout ranks (keys of CARRIED_METRICS), the same on every row. ``token_versions``
    and ``interrupted`` (rollout.partial): each sample's per-token versions and whether it was switched
    mid-generation; None: every token is ``version``'s. ``regenerated``: the batch is generated again
    (trainer.stale_policy=regenerate). ``baseline_B``: ReMax's baseline of each row."""
    measured = dict(measured or {})
    unknown = sorted(set(measured) - set(CARRIED_METRICS))
    if unknown:  # a new metric must be listed to reach the log, not be dropped on the way
        raise ValueError(f"metrics {unknown} cannot travel with the rows: add them to CARRIED_METRICS")
    batch = policy_batch(samples, pad_id, device)
    assert batch.token_rewards_BT is not None
    B = batch.num_rows
    n_gens = samples.gens

    def column(values: list[float] | list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).view(B, 1)

    first = [1] + [0] * (B - 1)
    versions_BT = torch.full_like(batch.input_ids_BT, version, dtype=torch.long)
    if token_versions is not None:
        for i, (g, v) in enumerate(zip(n_gens, token_versions, strict=True)):
            start = len(samples.prompts[g.prompt_index].prompt_ids)
            versions_BT[i, start : start + len(v)] = torch.tensor(v, dtype=torch.long)
    return {
        "input_ids_BT": batch.input_ids_BT,
        "attention_mask_BT": batch.attention_mask_BT,
        "response_mask_BT": batch.response_mask_BT,
        "engine_logprobs_BT": batch.engine_logprobs_BT,
        "token_rewards_BT": batch.token_rewards_BT,
        TOKEN_VERSIONS: versions_BT,
        "score": samples.scores_B.to(device=device, dtype=torch.float32).view(B, 1),
        "version": column([version] * B, torch.long),
        "data_index": column([samples.prompts[g.prompt_index].index for g in n_gens], torch.long),
        "prompt_len": column([len(samples.prompts[g.prompt_index].prompt_ids) for g in n_gens], torch.long),
        "truncated": column([g.finish_reason == "length" for g in n_gens], torch.bool),
        "errors": column([samples.rewards.num_errors * f for f in first], torch.long),
        "timeouts": column([samples.rewards.num_timeouts * f for f in first], torch.long),
        "judge_errors": column([samples.rewards.num_judge_errors * f for f in first], torch.long),
        "judge_only": column([samples.rewards.num_judge_only * f for f in first], torch.long),
        "rm_nonfinite": column([samples.rewards.num_rm_nonfinite * f for f in first], torch.long),
        "rm_only": column([samples.rewards.num_rm_only * f for f in first], torch.long),
        "env_errors": column([samples.rewards.num_env_errors * f for f in first], torch.long),
        "rollout_s": column([seconds.get("rollout_s", 0.0)] * B, torch.float64),
        "reward_s": column([seconds.get("reward_s", 0.0)] * B, torch.float64),
        "rollout_wait_s": column([seconds.get("rollout_wait_s", 0.0)] * B, torch.float64),
        "memory_gb": column([peak_memory_gb(device)["memory_gb"]] * B, torch.float64),
        "interrupted": column(list(interrupted) if interrupted is not None else [False] * B, torch.bool),
        "regenerated": column([regenerated] * B, torch.bool),
        "baseline": (
            torch.full((B, 1), math.nan, dtype=torch.float32, device=device)
            if baseline_B is None
            else baseline_B.to(device=device, dtype=torch.float32).view(B, 1)
        ),
        "measured": torch.tensor(
            [measured.get(k, math.nan) for k in CARRIED_METRICS], dtype=torch.float64, device=device
        ).expand(B, -1),
        **pack_reward_extra(samples.rewards.extra, B, device),
        **pack_routed(batch.routed_experts_BTLK, B, device),
        **pack_images(batch.images, B, device),
    }


def pack_reward_extra(
    extra: Mapping[str, list[float]], B: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """RewardResult.extra as the two fields REWARD_EXTRA and REWARD_EXTRA_NAMES (0 wide when empty)."""
    keys = sorted(extra)
    bad = [k for k in keys if "\n" in k]
    if bad:  # the separator of the names on the wire
        raise ValueError(f"the reward function returned extra keys with a newline, {bad}: rename them")
    values = torch.empty(B, len(keys), dtype=torch.float64, device=device)
    for j, k in enumerate(keys):
        values[:, j] = torch.tensor(extra[k], dtype=torch.float64, device=device)
    names = torch.tensor(list("\n".join(keys).encode()), dtype=torch.long, device=device)
    return {REWARD_EXTRA: values, REWARD_EXTRA_NAMES: names.expand(B, -1)}


def unpack_reward_extra(rows: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """RewardResult.extra of the rows: each row's own keys (rows from different rollout ranks may name
    different ones), NaN in a row for a key it has not, as a colocated RewardResult holds them."""
    values, names = rows[REWARD_EXTRA].tolist(), rows[REWARD_EXTRA_NAMES].tolist()
    per_row: list[dict[str, float]] = []
    for vals, codes in zip(values, names, strict=True):
        text = bytes(c for c in codes if c).decode()  # the wire pads a narrower row with 0
        keys = text.split("\n") if text else []
        per_row.append(dict(zip(keys, vals, strict=False)))
    keys = sorted({k for row in per_row for k in row})
    return {k: [row.get(k, math.nan) for row in per_row] for k in keys}


def fill_missing_fields(
    rows: dict[str, torch.Tensor], version: int, carried: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """Rows saved in a queue before TOKEN_VERSIONS, ``interrupted``, ``regenerated``, the judge's and
    reward model's counts, ReMax's baseline and the reward's extra keys travelled (a checkpoint of an
    earlier release): every token of ``version``'s, nothing interrupted, generated again or failed by the
    judge or the reward model, no baseline, no extra keys and no Rollout wait, as they were generated; a
    field that no longer travels is dropped. The measured
    metrics go to CARRIED_METRICS' columns by name: ``carried``, the names the queue was saved with (None:
    saved without them, read by their count; an unknown count measured nothing that can be named)."""
    rows["measured"] = _measured_by_name(rows["measured"], carried)
    if TOKEN_VERSIONS not in rows:
        rows[TOKEN_VERSIONS] = torch.full_like(rows["input_ids_BT"], version, dtype=torch.long)
    if "interrupted" not in rows:
        rows["interrupted"] = torch.zeros_like(rows["version"], dtype=torch.bool)
    if "regenerated" not in rows:
        rows["regenerated"] = torch.zeros_like(rows["version"], dtype=torch.bool)
    for name in ("judge_errors", "judge_only", "rm_nonfinite", "rm_only"):
        if name not in rows:
            rows[name] = torch.zeros_like(rows["version"], dtype=torch.long)
    if "baseline" not in rows:
        rows["baseline"] = torch.full_like(rows["version"], math.nan, dtype=torch.float32)
    if "rollout_wait_s" not in rows:  # saved under an earlier name, or before it travelled: not counted
        rows["rollout_wait_s"] = torch.zeros_like(rows["version"], dtype=torch.float64)
    for name in set(rows) - set(SPEC):  # a field that no longer travels
        del rows[name]
    B = rows["version"].shape[0]
    for name in (REWARD_EXTRA, REWARD_EXTRA_NAMES):
        if name not in rows:  # the reward's extra keys did not travel: none
            rows[name] = torch.zeros(B, 0, dtype=SPEC[name], device=rows["version"].device)
    if ROUTED not in rows:  # saved before the routing travelled: none
        rows.update(pack_routed(None, B, rows["version"].device))
    if IMAGE_SHAPE not in rows:  # saved before the images travelled: none (a text model's rows)
        rows.update(pack_images(None, B, rows["version"].device))
    return rows


def _measured_by_name(measured_BM: torch.Tensor, carried: Sequence[str] | None) -> torch.Tensor:
    names = _UNNAMED_CARRIED.get(measured_BM.shape[1], ()) if carried is None else tuple(carried)
    if names == CARRIED_METRICS[: len(names)] and len(names) == measured_BM.shape[1]:
        return measured_BM  # the current order (or its first part): as it is
    out = torch.full(
        (measured_BM.shape[0], len(CARRIED_METRICS)),
        math.nan,
        dtype=measured_BM.dtype,
        device=measured_BM.device,
    )
    for j, name in enumerate(names[: measured_BM.shape[1]]):
        if name in CARRIED_METRICS:  # a metric no longer carried is dropped
            out[:, CARRIED_METRICS.index(name)] = measured_BM[:, j]
    return out


def transfer(
    fields: dict[str, torch.Tensor] | None, layout: BatchLayout, device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The rows from the rollout ranks (``fields``: this rank's, None on a trainer rank) to the trainer
    ranks; returns a trainer rank's rows, None on a rollout rank. Rollout and trainer ranks call it."""
    return move_rows(fields, SPEC, layout.rollout, layout.trainer, width=None, device=device)


@dataclass
class ReceivedBatch:
    """A trainer rank's share of a generated batch: GRPO's two views of it, and what came with it."""

    batch: PolicyBatch
    samples: ScoredSamples
    versions_B: torch.Tensor
    # The slowest sending rank's rollout_s / reward_s (/ rollout_wait_s) among these rows.
    seconds: dict[str, float]
    memory_gb: float  # the largest sending rank's peak memory among them
    # Per token, the version that sampled it (TOKEN_VERSIONS), and per row whether rollout.partial
    # switched its weights mid-generation.
    versions_BT: torch.Tensor | None = None
    interrupted_B: torch.Tensor | None = None
    # trainer.stale_policy=regenerate: per row, whether the rollout ranks generated it again.
    regenerated_B: torch.Tensor | None = None
    # algorithm.adv_estimator=remax: each row's baseline, its prompt's greedy reward (None otherwise).
    baseline_B: torch.Tensor | None = None
    # (samples.metrics: the rollout ranks' reduced metrics that came with the rows, CARRIED_METRICS)

    def timings(self, timer: PhaseTimer) -> dict[str, float]:
        """The rollout ranks' generation and scoring seconds as the step's phases, and what their Rollout
        waited as the metric a colocated run logs it as (rollout/wait_s, Rollout.take_metrics)."""
        for phase, seconds in self.seconds.items():
            if phase != "rollout_wait_s":
                timer.add(phase.removesuffix("_s"), seconds)
        wait = self.seconds.get("rollout_wait_s")
        return {} if wait is None else {"rollout/wait_s": wait}

    def without_stale(
        self, step: int, k: int, per_token: bool, device: torch.device, group: dist.ProcessGroup | None
    ) -> tuple[PolicyBatch, dict[str, float]]:
        """The rows for update ``step`` without what is older than ``k`` (trainer.stale_policy=drop), and
        ``async/*``; ``per_token`` (rollout.partial): a row may hold several versions' tokens."""
        assert self.regenerated_B is not None and self.interrupted_B is not None
        mask_BT, metrics = mask_stale(
            step,
            k,
            self.batch.response_mask_BT,
            self.versions_B,
            self.regenerated_B,
            device,
            group,
            versions_BT=self.versions_BT if per_token else None,
            interrupted_B=self.interrupted_B,
        )
        return self.batch.replace(response_mask_BT=mask_BT), metrics


def unpack(
    rows: dict[str, torch.Tensor], train_ds: PromptDataset, tokenizer: object, n: int, pad_id: int
) -> ReceivedBatch:
    """The PolicyBatch and ScoredSamples a colocated rank would have built from these rows' generation:
    trimmed to the longest row, padded with ``pad_id``, each sample's tokens and logprobs cut out again."""
    lengths_B = rows["attention_mask_BT"].sum(dim=1)
    width = int(lengths_B.max())
    t = {k: rows[k][:, :width] for k in ROW_FIELDS}
    # The wire pads with 0; a colocated batch pads input ids with the tokenizer's pad id.
    t["input_ids_BT"] = t["input_ids_BT"].masked_fill(t["attention_mask_BT"] == 0, pad_id)
    batch = PolicyBatch.from_tensors(t).replace(
        routed_experts_BTLK=unpack_routed(rows, width), images=unpack_images(rows)
    )
    col = {k: rows[k][:, 0] for k in COLUMNS}
    B = batch.num_rows
    if B % n:
        raise ValueError(f"{B} rows are not whole groups of rollout.n={n}")
    prompt_len, lengths = col["prompt_len"].tolist(), lengths_B.tolist()
    ids, lps = batch.input_ids_BT.tolist(), batch.engine_logprobs_BT.tolist()
    gens = [
        Generation(
            prompt_index=i // n,
            token_ids=ids[i][prompt_len[i] : lengths[i]],
            logprobs=lps[i][prompt_len[i] : lengths[i]],
            finish_reason="length" if bool(col["truncated"][i]) else "stop",
        )
        for i in range(B)
    ]
    prompts = [train_ds[int(col["data_index"][i])] for i in range(0, B, n)]
    scores_B = col["score"].to(torch.float32).cpu()
    rewards = RewardResult(
        scores_B,
        int(col["errors"].sum()),
        int(col["timeouts"].sum()),
        unpack_reward_extra(rows),
        num_judge_errors=int(col["judge_errors"].sum()),
        num_judge_only=int(col["judge_only"].sum()),
        num_rm_nonfinite=int(col["rm_nonfinite"].sum()),
        num_rm_only=int(col["rm_only"].sum()),
        num_env_errors=int(col["env_errors"].sum()),
    )
    responses = tokenizer.batch_decode([g.token_ids for g in gens], skip_special_tokens=True)  # type: ignore[attr-defined]
    # Every row carries the same reduced values (the rollout ranks' group-wide metrics): the first row's.
    # (move_rows refuses a wire narrower than the field, so nothing measured is cut off here.)
    measured = rows["measured"][0, : len(CARRIED_METRICS)].tolist()
    metrics = {k: v for k, v in zip(CARRIED_METRICS, measured, strict=False) if not math.isnan(v)}
    samples = ScoredSamples(prompts, gens, rewards, responses, scores_B, metrics=metrics)
    seconds = {k: float(col[k].max()) for k in ("rollout_s", "reward_s", "rollout_wait_s")}
    if not seconds["rollout_wait_s"]:  # logged (rollout/wait_s) only where a Rollout waited
        del seconds["rollout_wait_s"]
    baseline_B = col["baseline"].to(torch.float32)
    has_baseline = not bool(baseline_B.isnan().all())
    return ReceivedBatch(
        batch,
        samples,
        col["version"].long(),
        seconds,
        float(col["memory_gb"].max()),
        versions_BT=rows[TOKEN_VERSIONS][:, :width].long(),
        interrupted_B=col["interrupted"].bool(),
        regenerated_B=col["regenerated"].bool(),
        baseline_B=baseline_B if has_baseline else None,
    )
