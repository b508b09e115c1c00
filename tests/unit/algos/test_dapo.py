"""DAPO's dynamic sampling and overlong shaping against hand-computed values and verl's rules
(verl 0.9.1's ``verl/trainer/ppo/v1/replay_buffer.py``, ``verl/workers/reward_manager/dapo.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spmdrl.algos.dapo import (
    dynamic_sampling_metrics,
    groups_with_signal,
    overlong_penalty,
    should_generate_more,
)


def _ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def _verl_keep(values: list[float], ids: list[int]) -> list[bool]:
    """verl 0.9.1's rule (ReplayBuffer._dapo_filtered_keys), written out: drop a uid iff it has more than
    one sample and np.std of its values == 0."""
    by_uid: dict[int, list[float]] = {}
    for uid, v in zip(ids, values, strict=True):
        by_uid.setdefault(uid, []).append(v)
    dropped = {u for u, vs in by_uid.items() if len(vs) > 1 and float(np.std(vs)) == 0.0}
    return [u not in dropped for u in ids]


# ---------------------------------------------------------------------------------------------- the filter


def test_all_equal_groups_are_dropped_mixed_kept():
    # group 0 all right, group 1 all wrong, group 2 mixed
    acc = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    ids = _ids([0, 0, 0, 1, 1, 1, 2, 2, 2])
    keep = groups_with_signal(acc, ids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False] * 6 + [True] * 3


def test_groups_of_one_are_kept_as_verl():
    values = torch.tensor([0.0, 1.0, 1.0, 1.0])
    ids = _ids([5, 7, 8, 8])  # 5 and 7 alone; 8 all equal
    assert groups_with_signal(values, ids).tolist() == [True, True, False, False]
    assert _verl_keep(values.tolist(), ids.tolist()) == [True, True, False, False]


def test_non_consecutive_ids_and_interleaved_groups():
    # groups interleaved (not contiguous), ids neither consecutive nor sorted, sizes 3 and 2
    values = torch.tensor([0.5, 2.0, 0.5, 2.0, 0.25])
    ids = _ids([42, -3, 42, -3, 42])
    assert groups_with_signal(values, ids).tolist() == [True, False, True, False, True]


def test_tiny_float_differences_are_signal():
    one_up32 = float(np.nextafter(np.float32(1.0), np.float32(2.0)))  # 1 + 2^-23
    v32 = torch.tensor([1.0, one_up32, 1.0, 1.0, 1e-30, 0.0], dtype=torch.float32)
    ids = _ids([0, 0, 1, 1, 2, 2])
    assert groups_with_signal(v32, ids).tolist() == [True, True, False, False, True, True]
    # float64 with a one-ulp difference, kept; verl agrees (np.std > 0)
    v64 = torch.tensor([0.1, 0.1 + 2**-56, 0.3, 0.3], dtype=torch.float64)
    ids64 = _ids([0, 0, 1, 1])
    assert groups_with_signal(v64, ids64).tolist() == _verl_keep(v64.tolist(), ids64.tolist())
    assert groups_with_signal(v64, ids64).tolist() == [True, True, False, False]


def test_bool_int_and_nonfinite_metrics():
    ids = _ids([0, 0, 1, 1])
    assert groups_with_signal(torch.tensor([True, False, True, True]), ids).tolist() == [
        True,
        True,
        False,
        False,
    ]
    assert groups_with_signal(torch.tensor([3, 4, 2, 2]), ids).tolist() == [True, True, False, False]
    # A NaN or an infinity keeps its group, as verl 0.9.1 (its std is NaN and NaN == 0 is false; the legacy
    # DAPO recipe's std > 0 dropped it), even when all its values are the same infinity.
    nan, inf = float("nan"), float("inf")
    values = torch.tensor([nan, 1.0, inf, 0.0, nan, inf, inf, inf, 2.0, 2.0])
    ids = _ids([0, 0, 1, 1, 2, 3, 4, 4, 5, 5])
    with np.errstate(invalid="ignore"):
        expected = _verl_keep(values.tolist(), ids.tolist())
    assert expected == [True] * 8 + [False, False]
    assert groups_with_signal(values, ids).tolist() == expected


def test_matches_verl_rule_on_random_batches():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B = int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(0, 8, (B,), generator=g)
        values = torch.randint(0, 3, (B,), generator=g).double() / 2
        assert groups_with_signal(values, ids).tolist() == _verl_keep(values.tolist(), ids.tolist())


def test_filter_checks_shapes():
    with pytest.raises(ValueError, match="differ"):
        groups_with_signal(torch.zeros(3), _ids([0, 0]))
    with pytest.raises(ValueError, match="integer"):
        groups_with_signal(torch.zeros(2), torch.zeros(2))
    assert groups_with_signal(torch.zeros(0), _ids([])).tolist() == []


# ---------------------------------------------------------------------------------------------- filling the batch


def test_enough_after_one_batch():
    assert should_generate_more(8, 8, num_gen_batches=1, max_num_gen_batches=10) is False
    assert should_generate_more(11, 8, num_gen_batches=1, max_num_gen_batches=1) is False


def test_needs_a_second_batch():
    assert should_generate_more(5, 8, num_gen_batches=1, max_num_gen_batches=10) is True
    assert should_generate_more(9, 8, num_gen_batches=2, max_num_gen_batches=10) is False


def test_no_limit_when_max_is_non_positive():
    assert should_generate_more(0, 8, num_gen_batches=1000, max_num_gen_batches=0) is True
    assert should_generate_more(0, 8, num_gen_batches=1000, max_num_gen_batches=-1) is True


def test_exceeding_the_limit_raises_naming_the_option():
    # verl: short after the max_num_gen_batches-th batch is an error (num_gen_batches >= max)
    assert should_generate_more(3, 8, num_gen_batches=2, max_num_gen_batches=3) is True
    with pytest.raises(ValueError) as err:
        should_generate_more(3, 8, num_gen_batches=3, max_num_gen_batches=3)
    msg = str(err.value)
    assert "algorithm.filter_groups.max_num_gen_batches=3" in msg
    assert "0 = no limit" in msg and "trainer.global_batch_size" in msg
    assert "3 groups" in msg and "8 prompts" in msg


def test_metrics_names():
    m = dynamic_sampling_metrics(num_gen_batches=3, num_kept_groups=10, num_dropped_groups=30)
    assert m == {
        "num_gen_batches": 3.0,
        "num_kept_groups": 10.0,
        "num_dropped_groups": 30.0,
        "kept_group_fraction": 0.25,
    }


# ---------------------------------------------------------------------------------------------- overlong shaping


def test_overlong_penalty_hand_values():
    # L_max 20, buffer 8: free up to 12, -p at 20
    lengths = torch.tensor([0, 5, 12, 16, 18, 20])
    pen = overlong_penalty(lengths, max_response_length=20, buffer_len=8, penalty_factor=1.0)
    assert pen.dtype == torch.float32
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, 0.0, -0.5, -0.75, -1.0]))
    pen2 = overlong_penalty(lengths, max_response_length=20, buffer_len=8, penalty_factor=0.5)
    torch.testing.assert_close(pen2, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.375, -0.5]))


def test_overlong_penalty_dapo_paper_setting():
    # DAPO: 16384 + 4096 tokens, factor 1: midpoint of the buffer -1/2, at the max -1
    lengths = torch.tensor([16384, 16384 + 2048, 20480])
    pen = overlong_penalty(lengths, 20480, 4096, 1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.5, -1.0]))


def test_overlong_beyond_max_is_not_clamped_as_verl():
    # verl's only clamp is min(., 0): 4 tokens past the max with an 8-token buffer -> -1.5 p
    pen = overlong_penalty(torch.tensor([24]), 20, 8, 2.0)
    torch.testing.assert_close(pen, torch.tensor([-3.0]))


def test_overlong_matches_verl_formula_per_sample():
    max_len, buf, factor = 100, 30, 0.7
    lengths = torch.arange(0, 101)
    pen = overlong_penalty(lengths, max_len, buf, factor)
    for L in range(101):
        # verl: exceed = L - (max - buf); min(-exceed / buf * factor, 0), with L a 0-dim long tensor
        exceed = torch.tensor(L) - (max_len - buf)
        ref = min(-exceed / buf * factor, 0)
        assert float(pen[L]) == float(ref)


def test_overlong_checks_options():
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(torch.tensor([1]), 20, 0, 1.0)
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty(torch.tensor([1]), 20, 21, 1.0)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(torch.tensor([1]), 20, 8, -1.0)
    with pytest.raises(ValueError, match="1-D"):
        overlong_penalty(torch.tensor([[1]]), 20, 8, 1.0)
