#!/usr/bin/env bash
# The main job on the built-in tiny default, on 2 CPU processes. Installs what it needs first
# (idempotent). Extra arguments are config overrides, e.g.  torchrun_scripts/tiny.sh trainer.total_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
bash torchrun_scripts/setup_cpu.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --nproc_per_node="${NPROC:-2}" -m spmdrl.train recipe="${RECIPE:-grpo_tiny}" "$@"
