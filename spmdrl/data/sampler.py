"""A stateful sampler that hands each rank its indices of each global batch, and resumes exactly.

Each epoch is a permutation of all indices from ``torch.Generator().manual_seed(seed + epoch)``, cut
to a whole number of global batches so every rank takes the same number of steps (the dropped tail
changes from epoch to epoch because the order does). Step ``s`` uses the slice
``[s * G, (s + 1) * G)`` of the permutation, G = batch_size_per_rank * world_size, and rank r takes the
r-th block of it. The global batch of a step therefore depends only on the seed, the epoch and G, not on
how it is split: a run saved on 4 ranks resumes on 2 with the same batches, provided G is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


class DistributedSampler:
    """This rank's indices for each step; ``state_dict`` / ``load_state_dict`` make it DCP ``Stateful``."""

    def __init__(
        self,
        num_samples: int,
        *,
        rank: int,
        world_size: int,
        batch_size_per_rank: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if batch_size_per_rank < 1:
            raise ValueError(f"batch_size_per_rank must be >= 1, got {batch_size_per_rank}")
        self.global_batch_size = batch_size_per_rank * world_size
        if num_samples < self.global_batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {self.global_batch_size} "
                f"({batch_size_per_rank} per rank x {world_size} ranks); lower trainer.global_batch_size "
                "or add data"
            )
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.batch_size_per_rank = batch_size_per_rank
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._step = 0
        self._order: torch.Tensor | None = None  # the current epoch's permutation, built on first use

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        """Batches already taken in the current epoch (0 right after an epoch ends)."""
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
        return self._order

    def next_batch(self) -> list[int]:
        """This rank's indices for the next step; after an epoch's last step the next epoch begins."""
        start = self._step * self.global_batch_size + self.rank * self.batch_size_per_rank
        batch = self._epoch_order()[start : start + self.batch_size_per_rank].tolist()
        self._step += 1
        if self._step == self.steps_per_epoch:
            self._epoch += 1
            self._step = 0
            self._order = None
        return batch

    def state_dict(self) -> dict[str, Any]:
        # The position plus what fixes the order, so a resume with different data or batch fails loudly.
        return {
            "epoch": self._epoch,
            "step_in_epoch": self._step,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, now in (
            ("num_samples", self.num_samples),
            ("global_batch_size", self.global_batch_size),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if state[key] != now:
                raise ValueError(
                    f"the checkpoint's sampler has {key}={state[key]} but this run has {now}; resuming would "
                    "give different batches. Use the same data, data.seed, data.shuffle and "
                    "trainer.global_batch_size as the saved run"
                )
        step = int(state["step_in_epoch"])
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"sampler state step_in_epoch={step} is outside 0..{self.steps_per_epoch - 1}")
        self._epoch = int(state["epoch"])
        self._step = step
        self._order = None
