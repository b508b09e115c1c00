"""The stateful per-rank sampler: sharding, determinism, epochs and exact resume."""

from __future__ import annotations

import pytest

from spmdrl.data.sampler import DistributedSampler


def make(num_samples: int, rank: int, world: int, per_rank: int = 3, seed: int = 7, shuffle: bool = True):
    return DistributedSampler(
        num_samples, rank=rank, world_size=world, batch_size_per_rank=per_rank, seed=seed, shuffle=shuffle
    )


def epoch_batches(sampler: DistributedSampler) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(sampler.steps_per_epoch)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_are_disjoint_and_cover_all_but_the_tail(world):
    num_samples, per_rank = 50, 3
    samplers = [make(num_samples, r, world, per_rank) for r in range(world)]
    steps = {s.steps_per_epoch for s in samplers}
    assert steps == {num_samples // (per_rank * world)}  # every rank takes the same number of steps
    per_rank_epoch = [epoch_batches(s) for s in samplers]
    for batches in per_rank_epoch:
        assert all(len(b) == per_rank for b in batches)
    seen = [i for batches in per_rank_epoch for b in batches for i in b]
    assert len(seen) == len(set(seen))  # no index goes to two ranks or twice to one
    assert len(seen) == (num_samples // (per_rank * world)) * per_rank * world
    assert set(seen) <= set(range(num_samples))
    # Every rank moved into epoch 1 together.
    assert {(s.epoch, s.step_in_epoch) for s in samplers} == {(1, 0)}


def test_without_shuffle_every_index_is_covered_in_order():
    samplers = [make(8, r, 2, per_rank=2, shuffle=False) for r in range(2)]
    step0 = [s.next_batch() for s in samplers]
    step1 = [s.next_batch() for s in samplers]
    assert step0 + step1 == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_deterministic_from_seed_and_epochs_differ():
    a, b, c = make(40, 0, 2, seed=3), make(40, 0, 2, seed=3), make(40, 0, 2, seed=4)
    epoch0_a, epoch0_b, epoch0_c = epoch_batches(a), epoch_batches(b), epoch_batches(c)
    assert epoch0_a == epoch0_b
    assert epoch0_a != epoch0_c
    epoch1_a = epoch_batches(a)
    assert epoch1_a != epoch0_a
    assert epoch1_a == epoch_batches(b)


def test_tail_dropped_varies_by_epoch():
    world, per_rank, n = 2, 3, 20  # 3 steps of 6 per epoch, 2 samples dropped each epoch
    samplers = [make(n, r, world, per_rank) for r in range(world)]
    dropped = []
    for _ in range(4):
        seen = {i for s in samplers for b in epoch_batches(s) for i in b}
        assert len(seen) == 18
        dropped.append(frozenset(range(n)) - seen)
    assert len(set(dropped)) > 1


def test_global_batch_does_not_depend_on_how_it_is_split():
    """Saved on 4 ranks, resumed on 2: the same global batches, provided the global batch is the same."""
    four = [make(48, r, 4, per_rank=2) for r in range(4)]
    two = [make(48, r, 2, per_rank=4) for r in range(2)]
    for _ in range(8):  # crosses an epoch boundary (6 steps per epoch)
        global_four = sorted(i for s in four for i in s.next_batch())
        global_two = sorted(i for s in two for i in s.next_batch())
        assert global_four == global_two


@pytest.mark.parametrize("k", [0, 1, 4, 5, 6, 11])
def test_resume_gives_identical_following_batches(k):
    # 30 samples, world 2 x 3 per rank: 5 steps per epoch, so k = 5, 6 and 11 sit on or past a boundary.
    for rank in range(2):
        straight = make(30, rank, 2)
        reference = [straight.next_batch() for _ in range(k + 12)]

        first = make(30, rank, 2)
        for _ in range(k):
            first.next_batch()
        state = first.state_dict()
        resumed = make(30, rank, 2)
        resumed.load_state_dict(state)
        assert (resumed.epoch, resumed.step_in_epoch) == (k // 5, k % 5)
        assert [resumed.next_batch() for _ in range(12)] == reference[k:]


def test_resume_rejects_a_different_run():
    s = make(30, 0, 2)
    s.next_batch()
    state = s.state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        make(31, 0, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        make(30, 0, 2, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size"):
        make(30, 0, 2, per_rank=2).load_state_dict(state)


def test_is_a_dcp_stateful():
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(make(30, 0, 2), Stateful)


def test_too_few_samples_for_one_global_batch():
    with pytest.raises(ValueError, match=r"7 samples, fewer than one global batch of 8 .*global_batch_size"):
        make(7, 0, 4, per_rank=2)
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        make(30, 2, 2)
