"""warmstart.*: the SFT stage run inside another job (an RL recipe's, the reward model's) before it trains,
on data.train_files' response column; the job starts from the stage's export."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from spmdrl.config import Config
from spmdrl.config_loader import import_entry
from spmdrl.errors import ConfigError
from spmdrl.logging.metrics import rewind_logs
from spmdrl.loop import StartPlan
from spmdrl.runtime import Run
from spmdrl.supervised.sft import train_sft

log = logging.getLogger("spmdrl")

STAGE = "sft"  # the stage's sub-directory of the job's output: its metrics, derived values and export
SHIPPED_ENTRY = "sft"  # warmstart.entry's default: recipes/sft.py, whose train_sft is this library's


def warmstart_config(cfg: Config) -> Config:
    """The SFT stage's config: the job's config with the warm-start's optimizer and batch settings; every
    weight trains unless warmstart.lora keeps model.lora's adapters (merged into the stage's export)."""
    ws = cfg.warmstart
    lora = cfg.model.lora if ws.lora else dataclasses.replace(cfg.model.lora, rank=0)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, lora=lora),
        optim=ws.optim,
        trainer=dataclasses.replace(
            cfg.trainer,
            total_steps=ws.total_steps,
            global_batch_size=ws.global_batch_size,
            micro_batch_size=ws.micro_batch_size,
            val_every=0,
            save_hf=True,
        ),
    )


def done_export(plan: StartPlan) -> Path | None:
    """A resumed job's warm-start export, which sits next to its checkpoints; None if there is none."""
    done = plan.resume_from.parent.parent / STAGE / "hf_model" if plan.resume_from else None
    return done if done is not None and (done / "config.json").is_file() else None


def warm_start(run: Run, plan: StartPlan) -> Path:
    """The SFT stage in this job; returns its HF export, which the job starts from. A resumed job's
    warm-start is done: its export sits next to the checkpoints."""
    done = done_export(plan)
    if done is not None:
        log.info("warm-start done earlier: %s", done)
        return done
    if run.env.is_main and plan.restarted:  # an attempt that died before its first checkpoint: start over
        rewind_logs(run.output_dir / STAGE, -1)
    # The library's stage; a fork's own SFT step when warmstart.entry names its file (a module with a
    # train_sft of this signature, checked at config load), as spmdrl.train runs a recipe by its entry.
    entry = run.cfg.warmstart.entry
    run_stage = train_sft if entry == SHIPPED_ENTRY else import_entry(entry).train_sft
    try:
        return run_stage(run, warmstart_config(run.cfg), stage=STAGE)
    except ConfigError as e:
        raise ConfigError(
            f"in the SFT warm-start (its trainer.* batch keys come from warmstart.*): {e}"
        ) from None


def val_only_model(plan: StartPlan, base_dir: Path) -> Path:
    """trainer.val_only in a job with warmstart.enabled: the model it evaluates is the checkpoint's, built
    from the warm-start export beside it, never a warm-start run here (validation only trains nothing)."""
    done = done_export(plan)
    if done is not None:
        return done
    where = (
        f"the checkpoint {plan.resume_from} has no warm-start export beside it ({STAGE}/hf_model)"
        if plan.resume_from is not None
        else "trainer.resume found no checkpoint to evaluate"
    )
    raise ConfigError(
        f"trainer.val_only=true with warmstart.enabled=true: {where}, and a validation-only run does not train "
        "the SFT warm-start. Point trainer.resume at a checkpoint of the run (or trainer.output_dir at its "
        f"directory), or set warmstart.enabled=false to evaluate model.path ({base_dir}) as it is"
    )
