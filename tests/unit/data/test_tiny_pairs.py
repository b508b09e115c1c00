"""spmdrl/data/tiny_pairs.py: preference pairs of the tiny task, deterministic, right answer chosen."""

from __future__ import annotations

from spmdrl.data.tiny_pairs import tiny_pairs
from spmdrl.data.tiny_task import TinyTaskConfig, generate
from spmdrl.rewards.tiny import compute_score

CFG = TinyTaskConfig(num_train=64, num_test=16, max_operand=9, correct_fraction=0.3, wrong_offset=1)


def test_chosen_right_rejected_wrong_by_the_rule() -> None:
    train, test = tiny_pairs(CFG, seed=0)
    rows_train, rows_test = generate(CFG)
    assert len(train) == 64 and len(test) == 16
    for pairs, rows in ((train, rows_train), (test, rows_test)):
        for p, row in zip(pairs, rows, strict=True):
            truth = row["reward_model"]["ground_truth"]
            assert p.messages == list(row["prompt"])
            # The ground truth decides, even where the train demonstration is wrong (correct_fraction=0.3).
            assert compute_score(p.chosen, truth) == 1.0
            assert compute_score(p.rejected, truth) == 0.0
            assert p.rejected != p.chosen and int(p.rejected.rsplit("#### ", 1)[1]) >= 0


def test_the_three_kinds_of_rejected_response() -> None:
    """Half a slip in the result, a quarter another final answer, a quarter a misread operand."""
    train, _ = tiny_pairs(TinyTaskConfig(num_train=2000, max_operand=9), seed=0)
    slip = other_final = misread = 0
    for p in train:
        working, final = p.rejected.split("\n#### ")
        lhs, result = working.split(" = ")
        if lhs == p.chosen.split(" = ")[0]:
            if result == final:
                slip += 1
                assert 1 <= abs(int(result) - int(p.chosen.rsplit("#### ", 1)[1])) <= 3
            else:
                other_final += 1
                assert result == p.chosen.rsplit("#### ", 1)[1]  # the right result, then a wrong answer
        else:
            misread += 1
            a, op, b = lhs.split(" ")
            assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(final)
    assert 900 < slip < 1100 and 400 < other_final < 600 and 400 < misread < 600, (slip, other_final, misread)


def test_deterministic_from_the_seed_and_held_out_from_test() -> None:
    a, b, c = tiny_pairs(CFG, 0), tiny_pairs(CFG, 0), tiny_pairs(CFG, 1)
    assert a == b
    assert [p.rejected for p in a[0]] != [p.rejected for p in c[0]]
    train_questions = {p.messages[0]["content"] for p in a[0]}
    assert not train_questions & {p.messages[0]["content"] for p in a[1]}
