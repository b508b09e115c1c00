"""``python -m spmdrl.export <checkpoint> <out_dir>``: a Hugging Face model directory from a checkpoint.

<checkpoint> is a ``step-<N>`` directory under a run's ``checkpoints/`` (or the run's output directory:
its newest complete checkpoint). Runs on one process, whatever world size saved it. A LoRA run's actor is
written merged into its base model, or with ``--adapter`` as the adapter alone in PEFT's format.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spmdrl.checkpoint.checkpointer import resolve_resume
from spmdrl.checkpoint.export import EXPORT_DTYPES, export_checkpoint
from spmdrl.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmdrl.export", description=__doc__.splitlines()[0])
    ap.add_argument(
        "checkpoint", type=Path, help="a step-<N> checkpoint directory, or a run's output directory"
    )
    ap.add_argument("out_dir", type=Path, help="where to write the HF model directory")
    ap.add_argument("--role", default="actor", choices=("actor", "critic"))
    ap.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write its adapter alone, in PEFT's format (default: merged into the base model)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=EXPORT_DTYPES,
        help="the weights' dtype (default auto: the run's model.param_dtype, bf16 on CUDA and float32 on "
        "CPU; a merged LoRA model float32)",
    )
    args = ap.parse_args(argv)
    try:
        path = resolve_resume(str(args.checkpoint), args.checkpoint)
    except ConfigError as e:
        print(f"error: {str(e).replace('trainer.resume=', '')}", file=sys.stderr)
        return 2
    assert path is not None
    try:
        export_checkpoint(
            path,
            args.out_dir,
            role=args.role,
            dtype=args.dtype,
            adapter_only=args.adapter,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "LoRA adapter" if args.adapter else "model"
    print(f"exported {path} ({args.role} {what}) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
