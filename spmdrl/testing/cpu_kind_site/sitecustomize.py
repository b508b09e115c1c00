"""Run by Python at start-up in a process whose PYTHONPATH names this folder, which only the tests' CPU-kind
emulation puts there (spmdrl.testing.cpu_kind.environment): the process emulates $SPMDRL_CPU_KIND before it
runs anything else, so before anything can import vLLM.
"""

import os

if os.environ.get("SPMDRL_CPU_KIND"):
    from spmdrl.testing.cpu_kind import apply_from_env

    apply_from_env()
