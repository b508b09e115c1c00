"""The RL batch of one rank: prompt + response rows and their per-token quantities."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PolicyBatch:
    """Right-padded rows; every ``_BT`` tensor is indexed at the token's own position.

    ``response_mask_BT`` marks sampled tokens (the only ones the loss sees). Rows come in
    consecutive groups of ``rollout.n`` samples of one prompt.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    engine_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor
    # Filled in before the update: the trainer's logprobs before it (PPO's "old" policy) and the
    # reference model's; zeros when not needed.
    old_logprobs_BT: torch.Tensor
    ref_logprobs_BT: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.input_ids_BT.shape[0]

    def rows(self, start: int, stop: int) -> PolicyBatch:
        """Rows [start, stop), trimmed to their longest sequence (less padding per micro-batch)."""
        width = int(self.attention_mask_BT[start:stop].sum(dim=1).max())
        return PolicyBatch(
            **{
                f.name: (t[start:stop, :width] if t.dim() == 2 else t[start:stop])
                for f in dataclasses.fields(self)
                for t in [getattr(self, f.name)]
            }
        )

    def to(self, device: torch.device) -> PolicyBatch:
        return PolicyBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})
