"""The teacher's tokenizer check (spmdrl/rl/teacher.py check_same_tokenizer) on real tokenizers: the built-in
tiny tokenizer against itself and against altered copies of it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from spmdrl.errors import ConfigError
from spmdrl.models.tiny import build_tokenizer
from spmdrl.rl.teacher import check_same_tokenizer

STUDENT, TEACHER = Path("student_dir"), Path("teacher_dir")


def test_the_same_tokenizer_passes():
    check_same_tokenizer(build_tokenizer(), build_tokenizer(), STUDENT, TEACHER)


def _refused(teacher: object) -> str:
    with pytest.raises(ConfigError) as e:
        check_same_tokenizer(build_tokenizer(), teacher, STUDENT, TEACHER)
    msg = str(e.value)
    # What, where (both directories) and the fix.
    assert "teacher.path" in msg and "teacher_dir" in msg and "student_dir" in msg, msg
    assert "share one tokenizer" in msg, msg
    return msg


def test_a_larger_vocabulary_is_refused():
    teacher = build_tokenizer()
    teacher.add_tokens(["<extra_word>"])
    assert "tokens against the actor's" in _refused(teacher)


def test_another_special_token_is_refused():
    teacher = build_tokenizer()
    teacher.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    msg = _refused(teacher)
    assert "tokens against the actor's" in msg or "special tokens" in msg


def test_another_eos_is_refused():
    teacher = copy.deepcopy(build_tokenizer())
    teacher.eos_token = "<|im_start|>"
    assert "eos_token is id" in _refused(teacher)


def test_other_ids_for_the_same_vocabulary_size_are_refused():
    # A tokenizer of the same size whose pieces map to other ids: its vocabulary differs token by token.
    student = build_tokenizer()
    data = json.loads(student.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    swapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token=student.eos_token,
        pad_token=student.pad_token,
    )
    msg = _refused(swapped)
    assert "other ids" in msg or "probe text" in msg, msg
