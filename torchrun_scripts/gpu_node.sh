#!/usr/bin/env bash
# One GPU node, every GPU this job may use: torchrun_scripts/gpu_node.sh recipe=grpo_gsm8k [overrides...]
# Needs spmdrl installed with the GPU extra: pip install -e ".[gpu]"
#
# One rank per GPU that torch sees, so CUDA_VISIBLE_DEVICES (and a MIG slice given through it) is
# honoured; nvidia-smi -L would list every GPU and MIG device of the machine whatever it says.
# NPROC=<n> sets the count instead; PYTHON=<interpreter> names the environment to ask (default: the
# python next to torchrun, which is the one that will run the ranks).
set -euo pipefail
TORCHRUN=$(command -v torchrun || true)
if [[ -z "$TORCHRUN" ]]; then
    echo "gpu_node.sh: torchrun not found on PATH; activate the environment spmdrl is installed in" >&2
    exit 1
fi
if [[ -z "${NPROC:-}" ]]; then
    PYTHON=${PYTHON:-$(dirname "$TORCHRUN")/python}
    [[ -x "$PYTHON" ]] || PYTHON=python3
    if ! NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())'); then
        echo "gpu_node.sh: could not count GPUs with $PYTHON (is torch installed there?); set PYTHON or NPROC" >&2
        exit 1
    fi
fi
if ! [[ "$NPROC" =~ ^[0-9]+$ ]] || ((NPROC < 1)); then
    echo "gpu_node.sh: no GPU to run on: NPROC=$NPROC, CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}." \
        "Check nvidia-smi, that torch is a CUDA build (python -c 'import torch; print(torch.version.cuda)')" \
        "and CUDA_VISIBLE_DEVICES, or set NPROC=<ranks>." >&2
    exit 1
fi
exec "$TORCHRUN" --standalone --nproc_per_node="$NPROC" -m spmdrl.train "$@"
