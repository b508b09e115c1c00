"""The KL term's reference policy (Reference): a frozen model of its own, or under LoRA the actor itself
scored with its adapters off (verl's way: the frozen base is the reference, so no second copy is built).

spmdrl.rl.models.build_models chooses; whoever scores the reference (old_and_ref_logprobs) runs
``ref.model`` inside ``ref.scoring()`` and never asks which of the two it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from spmdrl.models.lora import adapters_disabled


@dataclass(frozen=True)
class Reference:
    """``model``: the module to score; ``adapters_off``: it is the LoRA actor, scored as its frozen base."""

    model: nn.Module
    adapters_off: bool = False

    @contextmanager
    def scoring(self) -> Iterator[None]:
        """Where ``model`` computes the reference's logprobs. For the actor: eval mode (a frozen reference
        is built in it, so any dropout of the base model is off as there) and every adapter off; both
        restored on leaving, an exception included."""
        if not self.adapters_off:
            yield
            return
        training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                yield
        finally:
            self.model.train(training)

    def describe(self) -> str:
        if self.adapters_off:
            return "the actor with its LoRA adapters off (no copy of its own)"
        return "a frozen copy of model.path"
