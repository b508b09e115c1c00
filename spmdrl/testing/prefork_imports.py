"""What the tests' fork server (spmdrl.testing.prefork) imports once, before it forks any process: the
stack every spmdrl.train job and most spawned test ranks import first, vLLM included on a CPU host.

vLLM's import is prepared as a job prepares it (spmdrl.rollout.vllm_process's environment and
``inert_freezes``). On a CPU host it changes none of the process settings that the engine records
against the trainer's (spmdrl.rollout.vllm_process.SettingsSwap), which is checked here: a changed one
stops the fork server with the reason, rather than let jobs start from vLLM's settings. On a CUDA host
``import vllm`` disables cuDNN SDPA, so vLLM is left for each job to import, as a real run does.

Everything imported here is then frozen (``gc.freeze``): a forked process's collections skip it. The
environment the imports leave is written where ``SPMDRL_PREFORK_ENV_FILE`` says, for the test process.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os

from spmdrl.testing import cpu_kind

# Before anything imports vLLM: the CPU kind the tests run as (--cpu-kind), which the server's sitecustomize
# has applied already when its PYTHONPATH names it (spmdrl.testing.cpu_kind); here it does not depend on that.
cpu_kind.apply_from_env()

# In a job's order: spmdrl first, then what spmdrl.train and the recipes load. Each for its side effect.
for _name in (
    "spmdrl",
    "spmdrl.train",
    "spmdrl.config_loader",
    "spmdrl.preflight",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.utils.tensorboard",
    "transformers",
):
    importlib.import_module(_name)
# The curves' plotting library, where installed (the optional `plot` extra).
if importlib.util.find_spec("matplotlib") is not None:
    importlib.import_module("matplotlib")

import torch  # noqa: E402

import spmdrl.config_loader  # noqa: E402 - loaded above, in order; named here for its functions
from spmdrl.gc_heap import inert_freezes  # noqa: E402
from spmdrl.rollout import vllm_engine, vllm_logs, vllm_process  # noqa: E402, F401 - vllm_engine: preloaded

# The recipes every RL job runs (and its SFT warm-start), by name, as the library reaches them.
for _entry in ("grpo", "sft"):
    spmdrl.config_loader.import_entry(_entry)

if not torch.cuda.is_available():
    vllm_process.prepare_environment()
    vllm_logs.install("cpu")  # as the engine does before its import: vLLM warns while it loads
    before = vllm_process.ProcessSettings.current()
    with inert_freezes():
        import vllm
        import vllm.v1.engine.llm_engine

        del vllm
    after = vllm_process.ProcessSettings.current()
    if after != before:
        raise RuntimeError(f"importing vLLM changed the process settings {before} -> {after}: not preloaded")

gc.freeze()

# The environment as the imports left it, for the test process (spmdrl.testing.prefork.compatible); written
# to a temporary name and renamed, so that it is read only whole.
_env_file = os.environ.pop("SPMDRL_PREFORK_ENV_FILE", "")
if _env_file:
    with open(_env_file + ".tmp", "w") as _f:
        json.dump(dict(os.environ), _f)
    os.replace(_env_file + ".tmp", _env_file)
