"""Rows moving between role groups: typed batch split / concat / select, row layouts, and the moves
themselves on 4 gloo processes (bit-exact round trips, checksums that match on the other mesh)."""

from __future__ import annotations

import pytest
import torch

from spmdrl.distributed.exchange import RowLayout
from spmdrl.rl.batch import PolicyBatch
from spmdrl.testing.spawn import run_distributed


def _batch(rows: int, width: int, seed: int) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    attn = (torch.arange(width) < lengths[:, None]).long()
    resp = attn.bool() & (torch.arange(width) >= 1)
    return PolicyBatch(
        input_ids_BT=torch.randint(0, 150_000, (rows, width), generator=g) * attn,
        attention_mask_BT=attn,
        response_mask_BT=resp,
        engine_logprobs_BT=-torch.rand(rows, width, generator=g) * resp,
        advantages_BT=torch.randn(rows, width, generator=g),
        token_rewards_BT=torch.randn(rows, width, generator=g),
    )


def _equal(a: PolicyBatch, b: PolicyBatch) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta
    )


def test_split_concat_select_round_trip() -> None:
    b = _batch(7, 9, seed=0)
    parts = b.split([2, 0, 5])
    assert [p.num_rows for p in parts] == [2, 0, 5]
    assert _equal(PolicyBatch.concat(parts), b)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(1))
    assert _equal(b.select(perm).select(torch.argsort(perm)), b)
    # Narrower batches are right-padded with 0 to the widest.
    narrow = _batch(3, 4, seed=2)
    both = PolicyBatch.concat([narrow, b])
    assert both.input_ids_BT.shape == (10, 9)
    assert (
        torch.equal(both.input_ids_BT[:3, :4], narrow.input_ids_BT)
        and int(both.input_ids_BT[:3, 4:].abs().sum()) == 0
    )
    with pytest.raises(ValueError, match="add up to 7"):
        b.split([3, 3])
    with pytest.raises(ValueError, match="values_BT is set in some"):
        PolicyBatch.concat([b, b.replace(values_BT=torch.zeros(7, 9))])
    assert _equal(PolicyBatch.from_tensors(b.tensors()), b)


def test_balanced_layout_even_counts_and_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    # Long rows all at the start: the contiguous layout gives one rank most of the tokens.
    lengths = torch.cat(
        [torch.randint(200, 300, (16,), generator=g), torch.randint(5, 20, (16,), generator=g)]
    )
    ranks = [2, 3, 5, 7]
    plain = RowLayout.contiguous(32, ranks)
    bal = RowLayout.balanced(lengths, ranks, chunks=2)
    for r in ranks:
        rows = bal.rows_of(r)
        assert rows.numel() == 8
        # Per chunk (mini-batch) too: 4 rows from each half.
        assert int((rows < 16).sum()) == 4
    assert plain.imbalance(lengths, ranks) > 1.8
    assert bal.imbalance(lengths, ranks) < 1.03
    # Deterministic: every rank computes the same layout.
    assert torch.equal(bal.owner_N, RowLayout.balanced(lengths.clone(), ranks, chunks=2).owner_N)
    with pytest.raises(ValueError, match="do not split evenly"):
        RowLayout.balanced(lengths, [0, 1, 2], chunks=1)


def _move_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from spmdrl.distributed.exchange import gather_lengths, move_rows

    counts = [3, 5, 4, 4]  # unequal on purpose
    local = _batch(counts[rank], 6 + rank, seed=10 + rank)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, local)
    width = max(b.input_ids_BT.shape[1] for b in everyone)
    full = PolicyBatch.concat(everyone)  # what the global row order means
    sizes, lengths = gather_lengths(local.attention_mask_BT.sum(dim=1), torch.device("cpu"))
    spec = local.field_spec()
    world_layout = RowLayout.from_counts(sizes)
    actor = RowLayout.contiguous(16, [0, 1])
    critic = RowLayout.balanced(lengths, [2, 3], chunks=2)
    out: dict = {"sizes": sizes, "lengths_ok": torch.equal(lengths, full.attention_mask_BT.sum(dim=1))}

    def move(batch: PolicyBatch | None, src: RowLayout, dst: RowLayout) -> PolicyBatch | None:
        moved = move_rows(
            None if batch is None else batch.tensors(),
            spec,
            src,
            dst,
            width=width,
            device=torch.device("cpu"),
        )
        return None if moved is None else PolicyBatch.from_tensors(moved)

    a = move(local, world_layout, actor)
    c = move(local, world_layout, critic)
    # Each rank holds exactly the global rows its layout gives it, in global order.
    out["actor_ok"] = a is None if rank >= 2 else _equal(a, full.select(actor.rows_of(rank)))
    out["critic_ok"] = c is None if rank < 2 else _equal(c, full.select(critic.rows_of(rank)))
    # critic -> actor (different layouts of the same rows), then back to where they were generated.
    a2 = move(c, critic, actor)
    out["critic_to_actor_ok"] = a2 is None if rank >= 2 else _equal(a2, a)  # type: ignore[arg-type]
    back = move(a2, actor, world_layout)
    assert back is not None
    own_width = local.input_ids_BT.shape[1]
    out["round_trip_ok"] = _equal(
        PolicyBatch.from_tensors({k: v[:, :own_width] for k, v in back.tensors().items()}), local
    ) and all(not v[:, own_width:].any() for v in back.tensors().values())
    # Checksums: the token ids and logprobs that arrived on the critic mesh add up to what was sent.
    sent = torch.tensor(
        [float(local.input_ids_BT.sum()), float(local.engine_logprobs_BT.double().sum())], dtype=torch.float64
    )
    got = torch.tensor(
        [float(c.input_ids_BT.sum()), float(c.engine_logprobs_BT.double().sum())]
        if c is not None
        else [0.0, 0.0],
        dtype=torch.float64,
    )
    dist.all_reduce(sent)
    dist.all_reduce(got)
    out["checksums"] = (sent.tolist(), got.tolist())
    # A source rank that passes the wrong fields is told which.
    try:
        move_rows(
            {"input_ids_BT": local.input_ids_BT},
            spec,
            world_layout,
            actor,
            width=width,
            device=torch.device("cpu"),
        )
        out["bad_fields"] = "no error"
    except ValueError as e:
        out["bad_fields"] = str(e)
    return out


def test_rows_move_between_meshes_bit_exact() -> None:
    results = run_distributed(_move_worker, 4, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["sizes"] == [3, 5, 4, 4] and r["lengths_ok"], rank
        assert r["actor_ok"] and r["critic_ok"] and r["critic_to_actor_ok"] and r["round_trip_ok"], (rank, r)
        sent, got = r["checksums"]
        assert sent == got, (rank, sent, got)
        assert "fields" in r["bad_fields"] and "input_ids_BT" in r["bad_fields"], r["bad_fields"]


def _ragged_worker(rank: int, world: int) -> dict:
    """Ranks 2 and 3 send rows whose fields have widths of their own (rows as wide as the rank's longest,
    a per-row column, a 3-wide field) to ranks 0 and 1, with ``width=None``: no rank knows another's.
    Each field travels as its own dtype's bytes: ids past 2**53 (which a float64 wire would round),
    router-replay-like int16 experts and bfloat16 values of widths that do not fill a whole wire slot."""
    import torch.distributed as dist

    from spmdrl.distributed.exchange import move_rows

    spec = {
        "ids": torch.long,
        "score": torch.float32,
        "measured": torch.float64,
        "flag": torch.bool,
        "experts": torch.int16,
        "pixels": torch.bfloat16,
    }

    def rows_of(r: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(r)
        n, w = 4, 5 + 3 * (r - 2)  # rank 2: 5 wide, rank 3: 8 wide
        return {
            "ids": torch.randint(2**53 + 1, 2**62, (n, w), generator=g),
            "score": torch.randn(n, 1, generator=g),
            "measured": torch.randn(n, 3, generator=g, dtype=torch.float64),
            "flag": torch.rand(n, 1, generator=g) > 0.5,
            "experts": torch.randint(-1, 128, (n, 3 + r), generator=g, dtype=torch.int16),
            "pixels": torch.randn(n, 5, generator=g).to(torch.bfloat16),
        }

    src = RowLayout.from_counts([4, 4], [2, 3])
    dst = RowLayout.from_counts([3, 5], [0, 1])  # rank 1 gets rows of both senders
    got = move_rows(
        rows_of(rank) if rank >= 2 else None, spec, src, dst, width=None, device=torch.device("cpu")
    )
    out: dict = {"none": got is None}
    if got is not None:
        a, b = rows_of(2), rows_of(3)
        want_ids = torch.zeros(8, 8, dtype=torch.long)
        want_ids[:4, :5], want_ids[4:] = a["ids"], b["ids"]
        sel = dst.rows_of(rank)
        # Rank 0's rows all come from rank 2: 5 wide; rank 1's from both: as wide as rank 3's, 0-padded.
        out["ids_ok"] = torch.equal(got["ids"], want_ids[sel][:, : 5 if rank == 0 else 8])
        out["score_ok"] = torch.equal(got["score"], torch.cat([a["score"], b["score"]])[sel])
        out["measured_ok"] = torch.equal(got["measured"], torch.cat([a["measured"], b["measured"]])[sel])
        out["flag_ok"] = torch.equal(got["flag"], torch.cat([a["flag"], b["flag"]])[sel])
        want_experts = torch.zeros(8, 6, dtype=torch.int16)
        want_experts[:4, :5], want_experts[4:] = a["experts"], b["experts"]
        out["experts_ok"] = torch.equal(got["experts"], want_experts[sel][:, : 5 if rank == 0 else 6])
        out["pixels_ok"] = torch.equal(got["pixels"], torch.cat([a["pixels"], b["pixels"]])[sel])
        out["dtypes"] = {k: str(v.dtype) for k, v in got.items()}
        out["shapes"] = {k: tuple(v.shape) for k, v in got.items()}
    dist.barrier()
    return out


def test_rows_move_at_their_own_widths() -> None:
    results = run_distributed(_ragged_worker, 4, timeout_s=120)
    assert results[2]["none"] and results[3]["none"]
    for rank in (0, 1):
        r = results[rank]
        assert r["ids_ok"] and r["score_ok"] and r["measured_ok"] and r["flag_ok"], (rank, r)
        assert r["experts_ok"] and r["pixels_ok"], (rank, r)
        assert r["dtypes"] == {
            "ids": "torch.int64",
            "score": "torch.float32",
            "measured": "torch.float64",
            "flag": "torch.bool",
            "experts": "torch.int16",
            "pixels": "torch.bfloat16",
        }
    common = {"score": 1, "measured": 3, "flag": 1, "pixels": 5}
    assert results[0]["shapes"] == {k: (3, w) for k, w in {**common, "ids": 5, "experts": 5}.items()}
    assert results[1]["shapes"] == {k: (5, w) for k, w in {**common, "ids": 8, "experts": 6}.items()}


def test_each_field_costs_its_own_dtypes_bytes_on_the_wire() -> None:
    """A row of router replay's experts (int16) takes a quarter of the slots a float64 wire gave it, a
    float32 pixel row half, a mask an eighth; a width that does not fill a slot rounds up to one."""
    from spmdrl.distributed.exchange import _row_slots, _slots

    assert _slots(4096, torch.int16) == 1024 and _slots(4096, torch.float32) == 2048
    assert _slots(4096, torch.bool) == 512 and _slots(4096, torch.long) == 4096
    assert _slots(3, torch.int16) == 1 and _slots(0, torch.float32) == 0
    assert _row_slots([5, 1], {"ids": torch.long, "flag": torch.bool}) == 6
