"""What the unit tests of the asynchronous rows (spmdrl/rl/async_rows.py: pack_samples -> unpack) give
``unpack`` for the two things it reads besides the rows: a tokenizer whose decode is the ids themselves
(so a test reads the responses back without a vocabulary), and a training set that is a few prompts by
their dataset index."""

from __future__ import annotations

from spmdrl.data.prompts import PromptExample


class IdsTokenizer:
    """``batch_decode``: each sequence as its ids joined by spaces ("20 21")."""

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return [" ".join(map(str, i)) for i in ids]


class PromptsByIndex:
    """``prompts`` looked up by PromptExample.index, as ``train_ds[data_index]`` is."""

    def __init__(self, prompts: list[PromptExample]) -> None:
        self.prompts = {p.index: p for p in prompts}

    def __getitem__(self, i: int) -> PromptExample:
        return self.prompts[i]
