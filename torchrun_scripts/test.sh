#!/usr/bin/env bash
# Installs what the tests need (idempotent), then runs the whole test suite.
# Extra arguments go to pytest, e.g.  torchrun_scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash torchrun_scripts/setup_cpu.sh
exec .venv/bin/python -m pytest tests "$@"
