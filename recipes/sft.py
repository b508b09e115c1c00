"""Supervised fine-tuning, as one SPMD program.

    torchrun --nproc_per_node=2 -m spmdrl.train recipe=sft_tiny

The run is the library's SFT stage (spmdrl/supervised/sft.py: read train_sft top to bottom), the same one
an RL job runs as its warm-start (warmstart.*): a masked cross-entropy on response tokens normalized by the
global batch's token count, AdamW with grad-norm clipping, periodic validation with greedy samples,
checkpoints every trainer.save_every steps and after the last, from which a run resumes exactly
(docs/checkpointing.md), and an HF export at the end.

A fork that changes the step copies spmdrl/supervised/sft.py's train_sft here; warmstart.entry=my_sft.py
then runs the copy as an RL job's warm-start too.
"""

from __future__ import annotations

from spmdrl.config import Config
from spmdrl.runtime import start_run
from spmdrl.supervised.sft import train_sft
from spmdrl.trainer_config import check_val_only

__all__ = ["check_config", "main", "train_sft"]  # train_sft: what warmstart.entry=sft names


def check_config(cfg: Config) -> None:
    """Settings this recipe would not run fail at config load (spmdrl.config_loader calls this)."""
    check_val_only(cfg.trainer, cfg.data.val_files, cfg.name)  # trainer.val_only needs data.val_files


def main(cfg: Config) -> None:
    train_sft(start_run(cfg), cfg)


if __name__ == "__main__":
    # A forked copy runs as a script: torchrun --nproc_per_node=2 my_sft.py recipe=sft_tiny ...
    from spmdrl.train import run_recipe

    run_recipe(main)
