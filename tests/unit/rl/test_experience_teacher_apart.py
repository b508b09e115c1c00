"""The teacher on ranks of its own (parallel.teacher_ranks) on 4 gloo ranks, with a real FSDP2 teacher (the
tiny model): spmdrl/rl/experience.py teacher_logprobs_apart scores every rank's rows on the teacher's ranks
and brings the logprobs back, equal to those of the teacher sharded over every rank scoring its own rows;
spmdrl/rl/role_rows.py to_actor_ranks then delivers the rows with them, and their per-row columns (ReMax's
baselines, gdpo's components), to the actor's ranks in whole prompt groups, in global order; the teacher's
ranks keep none.

One spawned run goes through every case (starting 4 ranks costs seconds): the teacher on the last rank
(the actor on 3), and on the last 3 (the actor on 1; 20 rows over 3 teacher ranks: blocks of 7, 7 and 6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmdrl.config import Config, ModelConfig, ParallelConfig, RLDerived, TeacherConfig
from spmdrl.distributed.placement import plan_placement
from spmdrl.models.tiny import ensure_tiny_model
from spmdrl.rl.batch import PolicyBatch
from spmdrl.testing.small_runs import cache_dir
from spmdrl.testing.spawn import run_distributed

WORLD = 4
# (parallel.teacher_ranks, prompts, samples per prompt) of each case: the step's rows split evenly over the
# generating ranks and over the actor's, in whole groups.
CASES = ((1, 12, 2), (3, 4, 5))


def _global_rows(prompts: int, n: int) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor]:
    """Every row of a step in global order (a prompt's n samples consecutive), padded to the longest, with
    each row's baseline and two reward components."""
    g = torch.Generator().manual_seed(prompts * 10 + n)
    rows = prompts * n
    lengths = torch.randint(8, 40, (rows,), generator=g)
    width = int(lengths.max())
    attn_BT = (torch.arange(width) < lengths[:, None]).long()
    resp_BT = attn_BT.bool() & (torch.arange(width) >= 5)
    batch = PolicyBatch(
        input_ids_BT=torch.randint(3, 500, (rows, width), generator=g) * attn_BT,
        attention_mask_BT=attn_BT,
        response_mask_BT=resp_BT,
        engine_logprobs_BT=-torch.rand(rows, width, generator=g) * resp_BT,
        advantages_BT=torch.zeros(rows, width),
        token_rewards_BT=torch.randn(rows, width, generator=g) * resp_BT,
    )
    baseline_B = torch.rand(prompts, generator=g).repeat_interleave(n)
    components_BK = torch.randn(rows, 2, generator=g)
    return batch, baseline_B, components_BK


def _local(rank: int, prompts: int, n: int) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s generated rows (an equal block), trimmed to their own longest, as generated."""
    batch, baseline_B, components_BK = _global_rows(prompts, n)
    per = batch.num_rows // WORLD
    rows = torch.arange(rank * per, (rank + 1) * per)
    width = int(batch.attention_mask_BT[rows].sum(dim=1).max())
    return batch.take(rows, width), baseline_B[rows], components_BK[rows]


def _rl() -> RLDerived:
    # The no-grad passes read the micro-batch size (4 rows: several micro-batches per teacher rank).
    return RLDerived(
        samples_per_prompt=2,
        train_ranks=WORLD,
        mini_batches_per_step=1,
        per_rank_mini_batch_seqs=4,
        micro_batch_size=4,
        micro_batches_per_mini_batch=1,
        grad_accum_steps=1,
        optimizer_steps_per_step=1,
        max_model_len=64,
    )


def _worker(rank: int, world: int, model_dir: str) -> dict:
    from spmdrl.rl.experience import _teacher_logprobs, teacher_logprobs_apart
    from spmdrl.rl.role_rows import to_actor_ranks
    from spmdrl.rl.settings import update_settings
    from spmdrl.rl.teacher import build_teacher
    from spmdrl.rl.update import micro_rows

    cpu, path = torch.device("cpu"), Path(model_dir)
    cfg = Config(
        model=ModelConfig(path=model_dir, param_dtype="float32"), teacher=TeacherConfig(path=model_dir)
    )
    settings, rl = update_settings(cfg), _rl()
    out: dict = {}
    for teacher_ranks, prompts, n in CASES:
        local, baseline_B, components_BK = _local(rank, prompts, n)
        # The colocated teacher: sharded over every rank, each scoring its own rows.
        colocated = plan_placement(ParallelConfig(), world, needs_critic=False, teacher=True)
        meshes = colocated.build_meshes("cpu")
        teacher = build_teacher(cfg.teacher, cfg.model, cfg.trainer, path, cpu, meshes)
        want_BT = _teacher_logprobs(settings, teacher, local, micro_rows(cfg.trainer, rl, local))
        # The teacher on the last teacher_ranks ranks, which hold no actor.
        own = plan_placement(
            ParallelConfig(teacher_ranks=teacher_ranks), world, needs_critic=False, teacher=True
        )
        meshes = own.build_meshes("cpu")
        teacher = (
            build_teacher(cfg.teacher, cfg.model, cfg.trainer, path, cpu, meshes)
            if meshes.holds("teacher")
            else None
        )
        got_BT = teacher_logprobs_apart(settings, rl, teacher, local, own, meshes.group("teacher"), cpu)
        columns = {"baseline_B": baseline_B.view(-1, 1), "components_BK": components_BK}
        moved = to_actor_ranks(own, local.replace(teacher_logprobs_BT=got_BT), columns, cpu)
        out[teacher_ranks] = {
            "want": want_BT,
            "got": got_BT,
            "holds_teacher": meshes.holds("teacher"),
            "holds_actor": meshes.holds("actor"),
            "moved": None if moved is None else (moved[0].tensors(), moved[1]),
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    model_dir = ensure_tiny_model(cache_dir())
    return run_distributed(_worker, WORLD, str(model_dir), timeout_s=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"teacher_ranks={c[0]}")
def test_the_teacher_on_its_own_ranks_scores_every_rank_s_rows_as_the_colocated_teacher(
    results: list[dict], case: tuple[int, int, int]
) -> None:
    teacher_ranks = case[0]
    for rank, r in enumerate(results):
        c = r[teacher_ranks]
        assert c["holds_teacher"] == (rank >= WORLD - teacher_ranks), rank
        want, got = c["want"], c["got"]
        assert got.shape == want.shape, (rank, got.shape, want.shape)
        mask = _local(rank, *case[1:])[0].response_mask_BT
        # Float noise only (other micro-batches, so other padded widths); not a row or a position off.
        assert torch.allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5), (
            rank,
            (got - want)[mask].abs().max(),
        )
        assert float(want[mask].abs().min()) > 0, "the teacher's logprobs are not zero"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"teacher_ranks={c[0]}")
def test_the_actors_ranks_get_whole_groups_in_global_order_and_the_teachers_none(
    results: list[dict], case: tuple[int, int, int]
) -> None:
    teacher_ranks, prompts, n = case
    actor_ranks = WORLD - teacher_ranks
    full, baseline_B, components_BK = _global_rows(prompts, n)
    # The colocated teacher's logprobs of every row, in global order (ranks hold equal consecutive blocks).
    width = full.input_ids_BT.shape[1]
    teacher_BT = torch.cat(
        [
            torch.nn.functional.pad(r[teacher_ranks]["want"], (0, width - r[teacher_ranks]["want"].shape[1]))
            for r in results
        ]
    )
    per = full.num_rows // actor_ranks
    assert per % n == 0, "whole prompt groups per actor rank"
    for rank, r in enumerate(results):
        c = r[teacher_ranks]
        assert c["holds_actor"] == (rank < actor_ranks), rank
        if rank >= actor_ranks:
            assert c["moved"] is None, rank
            continue
        tensors, columns = c["moved"]
        rows = torch.arange(rank * per, (rank + 1) * per)
        w = tensors["input_ids_BT"].shape[1]
        want = full.select(rows).tensors()
        for k, v in want.items():
            assert torch.equal(tensors[k], v[:, :w]) and not v[:, w:].any(), (rank, k)
            assert tensors[k].dtype == v.dtype, (rank, k)
        mask = want["response_mask_BT"][:, :w]
        got_BT = tensors["teacher_logprobs_BT"]
        assert torch.allclose(got_BT[mask], teacher_BT[rows][:, :w][mask], rtol=1e-5, atol=1e-5), rank
        assert torch.equal(columns["baseline_B"].view(-1), baseline_B[rows]), rank
        assert torch.equal(columns["components_BK"], components_BK[rows]), rank
