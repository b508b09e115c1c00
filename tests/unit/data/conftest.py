"""Fixtures of the data tests (helpers in chat_data.py)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from tests.unit.data.chat_data import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()
