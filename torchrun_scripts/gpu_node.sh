#!/usr/bin/env bash
# One GPU node, all its GPUs: torchrun_scripts/gpu_node.sh recipe=grpo_gsm8k [overrides...]
# Needs spmdrl installed with the GPU extra: pip install -e ".[gpu]"
set -euo pipefail
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
exec torchrun --standalone --nproc_per_node="$NPROC" -m spmdrl.train "$@"
