"""The built-in teacher's recipe (spmdrl/models/tiny_teacher.py), without training it: another architecture
than the student's on the same tokenizer, and never a held-out question of recipe=opd_tiny in its data."""

from __future__ import annotations

import dataclasses

from spmdrl.config_loader import load_config
from spmdrl.data.tiny_task import TinyTaskConfig, generate
from spmdrl.models import tiny, tiny_teacher


def test_the_teacher_is_another_architecture_on_the_students_tokenizer():
    assert tiny_teacher.TEACHER_SHAPE["hidden_size"] != tiny.MODEL_SHAPE["hidden_size"]
    assert tiny_teacher.TEACHER_SHAPE["num_hidden_layers"] != tiny.MODEL_SHAPE["num_hidden_layers"]
    assert tiny.TINY_TEACHER in tiny.BUILT_IN_MODELS


def test_the_teacher_never_sees_opd_tinys_held_out_questions():
    cfg = load_config(["recipe=opd_tiny"])
    assert cfg.teacher.path == tiny.TINY_TEACHER and not cfg.teacher.use_task_rewards
    student_task = cfg.section(TinyTaskConfig)
    teacher_task = tiny_teacher.TEACHER_TASK
    # The same task but for the demonstrations' correctness: the same held-out split.
    assert dataclasses.replace(student_task, correct_fraction=1.0, wrong_offset=0) == teacher_task
    teacher_train, _ = generate(teacher_task)
    _, test = generate(student_task)
    seen = {r["extra_info"]["question"] for r in teacher_train}
    assert not seen & {r["extra_info"]["question"] for r in test}
    assert all(r["response"].endswith(f"#### {r['reward_model']['ground_truth']}") for r in teacher_train)
