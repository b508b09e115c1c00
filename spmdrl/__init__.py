"""spmdrl: RL post-training for language models as one SPMD PyTorch program."""

import os as _os

if _os.environ.get("SPMDRL_CPU_KIND"):
    # Before anything imports vLLM: this process detects the CPU flags of that kind (spmdrl.cpu_kind).
    from spmdrl.cpu_kind import apply_from_env as _apply_cpu_kind

    _apply_cpu_kind()
