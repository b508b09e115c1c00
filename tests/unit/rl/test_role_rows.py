"""spmdrl/rl/role_rows.py on 4 gloo ranks: plan_rows' layouts for each placement, RowPlan.move and
RowPlan.balance_colocated deliver every row bit-exact to the rank its layout names, in global order
(under parallel.placement=async, among the trainer ranks only).

One spawned run goes through every scenario (starting 4 ranks costs seconds); the tests assert on what
the ranks returned. Every rank builds the same global rows from a seed and holds a slice of them, so the
parent can rebuild what each rank should have received.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spmdrl.config import Config, ParallelConfig, RLDerived
from spmdrl.distributed.placement import Placement
from spmdrl.rl.batch import PolicyBatch
from spmdrl.rl.role_rows import RowPlan, fit_width, plan_rows
from spmdrl.testing.spawn import run_distributed

WORLD = 4
ROWS_PER_RANK = 4
N = WORLD * ROWS_PER_RANK


def _lengths() -> torch.Tensor:
    # Rank 0 generated the long rows, the others short ones: the as-generated layout is badly skewed.
    g = torch.Generator().manual_seed(0)
    return torch.cat(
        [
            torch.randint(40, 60, (ROWS_PER_RANK,), generator=g),
            torch.randint(3, 12, (N - ROWS_PER_RANK,), generator=g),
        ]
    )


def _global_rows() -> tuple[PolicyBatch, torch.Tensor]:
    """Every row of the step in global order, padded to the longest, and a sampled mask (a strict subset
    of the response mask, as after rejection) that must travel with its rows."""
    g = torch.Generator().manual_seed(1)
    lengths = _lengths()
    width = int(lengths.max())
    attn = (torch.arange(width) < lengths[:, None]).long()
    resp = attn.bool() & (torch.arange(width) >= 2)
    batch = PolicyBatch(
        input_ids_BT=torch.randint(3, 150_000, (N, width), generator=g) * attn,
        attention_mask_BT=attn,
        response_mask_BT=resp,
        engine_logprobs_BT=-torch.rand(N, width, generator=g) * resp,
        advantages_BT=torch.randn(N, width, generator=g) * resp,
        old_logprobs_BT=-torch.rand(N, width, generator=g) * resp,
    )
    sampled = resp & (torch.rand(N, width, generator=g) < 0.7)
    return batch, sampled


def _local(rank: int) -> tuple[PolicyBatch, torch.Tensor]:
    """Rank ``rank``'s generated rows, trimmed to their own longest (as build_policy_batch makes them)."""
    full, sampled = _global_rows()
    rows = torch.arange(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    width = int(full.attention_mask_BT[rows].sum(dim=1).max())
    local = full.select(rows)
    return PolicyBatch.from_tensors({k: v[:, :width] for k, v in local.tensors().items()}), sampled[
        rows, :width
    ]


def _rl(mini_batches: int) -> RLDerived:
    # plan_rows reads only mini_batches_per_step (the chunks each layout balances on its own).
    return RLDerived(
        samples_per_prompt=2,
        train_ranks=WORLD,
        mini_batches_per_step=mini_batches,
        per_rank_mini_batch_seqs=N // WORLD // mini_batches,
        micro_batch_size=1,
        micro_batches_per_mini_batch=1,
        grad_accum_steps=1,
        optimizer_steps_per_step=mini_batches,
        max_model_len=128,
    )


def _owners(plan: RowPlan) -> dict:
    return {
        name: None if (lay := getattr(plan, name)) is None else lay.owner_N
        for name in ("world", "actor", "critic")
    }


def _worker(rank: int, world: int) -> dict:
    cpu = torch.device("cpu")
    local, sampled = _local(rank)
    out: dict = {}

    # Colocated, not balanced: no layout, nothing moves, the very same objects come back.
    cfg = Config(parallel=ParallelConfig(placement="colocated", balance_tokens=False))
    plan = plan_rows(cfg.parallel.balance_tokens, Placement.colocated(world), _rl(2), local, cpu)
    b, s = plan.balance_colocated(local, sampled)
    out["colocated_plain"] = {
        "moves": plan.moves,
        "owners": _owners(plan),
        "metrics": plan.metrics,
        "same_objects": b is local and s is sampled,
    }

    # Colocated and balanced: the whole batch and the sampled mask go to the balanced layout.
    cfg = Config(parallel=ParallelConfig(placement="colocated", balance_tokens=True))
    plan = plan_rows(cfg.parallel.balance_tokens, Placement.colocated(world), _rl(2), local, cpu)
    b, s = plan.balance_colocated(local, sampled)
    assert b is not None and s is not None
    out["colocated_balanced"] = {
        "moves": plan.moves,
        "width": plan.width,
        "owners": _owners(plan),
        "critic_is_actor": plan.critic is plan.actor,
        "metrics": plan.metrics,
        "batch": b.tensors(),
        "sampled": s,
    }

    # Split (actor on 0-1, critic on 2-3), plain and balanced: the PPO recipe's moves over RowPlan.move.
    for balance in (False, True):
        cfg = Config(parallel=ParallelConfig(placement="split", critic_ranks=2, balance_tokens=balance))
        placement = Placement.split(world, 2)
        plan = plan_rows(cfg.parallel.balance_tokens, placement, _rl(2), local, cpu, rl_critic=_rl(1))
        assert plan.world is not None and plan.actor is not None and plan.critic is not None
        spec = local.field_spec()
        to_actor = plan.move(local.tensors(), spec, plan.world, plan.actor)
        to_critic = plan.move(local.tensors(), spec, plan.world, plan.critic)
        # The critic's values (here: a function of each row's tokens) to the actor ...
        values = None if to_critic is None else {"values_BT": to_critic["input_ids_BT"].float() * 0.5 - 1.0}
        values_at_actor = plan.move(values, {"values_BT": torch.float32}, plan.critic, plan.actor)
        # ... and the returns (a function of the values, computed where they arrived) back to the critic.
        returns = None if values_at_actor is None else {"returns_BT": values_at_actor["values_BT"] + 2.0}
        returns_at_critic = plan.move(returns, {"returns_BT": torch.float32}, plan.actor, plan.critic)
        # A split placement balances rows by moving them, never in balance_colocated.
        nb, ns = plan.balance_colocated(local, sampled)
        out[f"split_{'balanced' if balance else 'plain'}"] = {
            "moves": plan.moves,
            "width": plan.width,
            "owners": _owners(plan),
            "metrics": plan.metrics,
            "to_actor": to_actor,
            "to_critic": to_critic,
            "values_at_actor": values_at_actor,
            "returns_at_critic": returns_at_critic,
            "balance_colocated_noop": nb is local and ns is sampled,
        }

    # Async (trainer ranks 0-1, rollout ranks 2-3), balanced: the trainer ranks hold the step's rows (rows
    # 0-7, as received) and balance them among themselves, over their own group; the rollout ranks, busy
    # generating, never enter.
    trainers = dist.new_group([0, 1])  # every rank creates it, as the placement's meshes are
    if rank < 2:
        cfg = Config(parallel=ParallelConfig(placement="async", rollout_ranks=2, balance_tokens=True))
        plan = plan_rows(
            cfg.parallel.balance_tokens, Placement.asynchronous(world, 2), _rl(2), local, cpu, group=trainers
        )
        b, s = plan.balance_colocated(local, sampled)
        assert b is not None and s is not None
        out["async_balanced"] = {
            "owners": _owners(plan),
            "metrics": plan.metrics,
            "batch": b.tensors(),
            "sampled": s,
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, WORLD, timeout_s=180)


def _expected(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    full, _ = _global_rows()
    return full.select(rows).tensors()


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert got.keys() == want.keys(), where
    for k in want:
        assert got[k].dtype == want[k].dtype, (where, k, got[k].dtype)
        assert torch.equal(got[k], want[k]), (where, k)


def _tokens(owner_N: torch.Tensor, ranks: list[int]) -> list[int]:
    lengths = _lengths()
    return [int(lengths[owner_N == r].sum()) for r in ranks]


def test_colocated_without_balance_moves_nothing(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        c = r["colocated_plain"]
        assert c["moves"] is False and c["metrics"] == {}, rank
        assert c["owners"] == {"world": None, "actor": None, "critic": None}, rank
        assert c["same_objects"], rank


def test_colocated_balance_delivers_rows_and_mask_bit_exact_and_evens_tokens(results: list[dict]) -> None:
    _, sampled = _global_rows()
    lengths = _lengths()
    actor = results[0]["colocated_balanced"]["owners"]["actor"]
    for rank, r in enumerate(results):
        c = r["colocated_balanced"]
        assert c["moves"] and c["critic_is_actor"], rank
        assert c["width"] == int(lengths.max()), rank
        # Every rank computed the same layouts; the as-generated one is rank-major.
        assert torch.equal(c["owners"]["world"], torch.arange(WORLD).repeat_interleave(ROWS_PER_RANK)), rank
        assert torch.equal(c["owners"]["actor"], actor), rank
        rows = torch.nonzero(actor == rank).flatten()
        # Equal row counts, and each mini-batch (2 chunks of 8 rows) gives every rank 2 rows.
        assert rows.numel() == ROWS_PER_RANK and int((rows < N // 2).sum()) == 2, (rank, rows)
        # The rows the layout names, in global order, every field bit-exact; the mask stays with its rows.
        _assert_bit_exact(c["batch"], _expected(rows), f"rank {rank}")
        assert c["sampled"].dtype == torch.bool and torch.equal(c["sampled"], sampled[rows]), rank
    # Rank 0 generated all 4 long rows; balanced, each rank trains on one of them.
    assert sorted(int((actor[:ROWS_PER_RANK] == r).sum()) for r in range(WORLD)) == [1, 1, 1, 1]
    tokens = _tokens(actor, list(range(WORLD)))
    m = results[0]["colocated_balanced"]["metrics"]
    assert set(m) == {"balance/actor_token_imbalance", "balance/actor_token_imbalance_before"}
    assert m["balance/actor_token_imbalance"] == pytest.approx(max(tokens) / (sum(tokens) / WORLD))
    before = _tokens(torch.arange(WORLD).repeat_interleave(ROWS_PER_RANK), list(range(WORLD)))
    assert m["balance/actor_token_imbalance_before"] == pytest.approx(max(before) / (sum(before) / WORLD))
    assert m["balance/actor_token_imbalance_before"] > 2.0 and m["balance/actor_token_imbalance"] < 1.2


def test_async_balances_among_the_trainer_ranks_only(results: list[dict]) -> None:
    _, sampled = _global_rows()
    held = 2 * ROWS_PER_RANK  # the trainer ranks' rows: 0-7
    actor = results[0]["async_balanced"]["owners"]["actor"]
    assert "async_balanced" not in results[2] and "async_balanced" not in results[3]
    for rank in (0, 1):
        r = results[rank]["async_balanced"]
        assert torch.equal(r["owners"]["world"], torch.tensor([0, 1]).repeat_interleave(ROWS_PER_RANK)), rank
        assert torch.equal(r["owners"]["actor"], actor) and actor.numel() == held, rank
        rows = torch.nonzero(actor == rank).flatten()
        # Equal counts, 2 rows of each mini-batch (2 chunks of 4 rows), every field bit-exact.
        assert rows.numel() == ROWS_PER_RANK and int((rows < held // 2).sum()) == 2, (rank, rows)
        _assert_bit_exact(r["batch"], _expected(rows), f"rank {rank}")
        assert torch.equal(r["sampled"], sampled[rows]), rank
    # Rank 0 received the 4 long rows; balanced, each trainer rank trains on 2.
    assert sorted(int((actor[:ROWS_PER_RANK] == r).sum()) for r in (0, 1)) == [2, 2]
    m = results[0]["async_balanced"]["metrics"]
    assert m["balance/actor_token_imbalance_before"] > 1.5 > m["balance/actor_token_imbalance"]


@pytest.mark.parametrize("kind", ["split_plain", "split_balanced"])
def test_split_moves_rows_values_and_returns_between_roles(results: list[dict], kind: str) -> None:
    lengths = _lengths()
    actor_ranks, critic_ranks = [0, 1], [2, 3]
    owners = results[0][kind]["owners"]
    actor, critic = owners["actor"], owners["critic"]
    if kind == "split_plain":
        # Consecutive blocks over each role's ranks.
        assert torch.equal(actor, torch.tensor([0, 1]).repeat_interleave(N // 2))
        assert torch.equal(critic, torch.tensor([2, 3]).repeat_interleave(N // 2))
    else:
        # Equal rows per rank within each role's own mini-batches: the actor's 2, the critic's 1.
        for r in actor_ranks:
            rows = torch.nonzero(actor == r).flatten()
            assert rows.numel() == N // 2 and int((rows < N // 2).sum()) == N // 4, (r, rows)
        assert all(int((critic == r).sum()) == N // 2 for r in critic_ranks)
    for rank, r in enumerate(results):
        c = r[kind]
        assert c["moves"] and c["balance_colocated_noop"], rank
        assert c["width"] == int(lengths.max()), rank
        for name in ("world", "actor", "critic"):
            assert torch.equal(c["owners"][name], owners[name]), (rank, name)
        if rank in actor_ranks:
            rows = torch.nonzero(actor == rank).flatten()
            _assert_bit_exact(c["to_actor"], _expected(rows), f"actor rank {rank}")
            want_values = _expected(rows)["input_ids_BT"].float() * 0.5 - 1.0
            assert torch.equal(c["values_at_actor"]["values_BT"], want_values), rank
            assert c["to_critic"] is None and c["returns_at_critic"] is None, rank
        else:
            rows = torch.nonzero(critic == rank).flatten()
            _assert_bit_exact(c["to_critic"], _expected(rows), f"critic rank {rank}")
            want_returns = _expected(rows)["input_ids_BT"].float() * 0.5 + 1.0
            assert torch.equal(c["returns_at_critic"]["returns_BT"], want_returns), rank
            assert c["to_actor"] is None and c["values_at_actor"] is None, rank
    m = results[0][kind]["metrics"]
    for role, own, ranks in (("actor", actor, actor_ranks), ("critic", critic, critic_ranks)):
        tokens = _tokens(own, ranks)
        assert m[f"balance/{role}_token_imbalance"] == pytest.approx(max(tokens) / (sum(tokens) / len(ranks)))
    if kind == "split_plain":
        assert set(m) == {"balance/actor_token_imbalance", "balance/critic_token_imbalance"}
    else:
        plain = results[0]["split_plain"]["metrics"]
        assert m["balance/actor_token_imbalance_before"] == pytest.approx(
            plain["balance/actor_token_imbalance"]
        )
        assert m["balance/critic_token_imbalance_before"] == pytest.approx(
            plain["balance/critic_token_imbalance"]
        )
        # The long rows were all in the actor's first block: balancing evens them out.
        assert m["balance/actor_token_imbalance_before"] > 1.5 and m["balance/actor_token_imbalance"] < 1.1
        assert m["balance/critic_token_imbalance"] <= m["balance/critic_token_imbalance_before"]


def test_a_moved_field_fits_the_width_of_the_batch_it_joins() -> None:
    """Split with router replay: the critic's values arrive as wide as the critic's longest row, the actor's
    batch is as wide as its own; the values keep every column of the actor's rows and nothing past them."""
    values = torch.arange(12.0).reshape(2, 6)
    assert torch.equal(fit_width(values, 4), values[:, :4])
    wider = fit_width(values, 8)
    assert wider.shape == (2, 8) and torch.equal(wider[:, :6], values) and not wider[:, 6:].any()
    assert fit_width(values, 6) is values or torch.equal(fit_width(values, 6), values)
