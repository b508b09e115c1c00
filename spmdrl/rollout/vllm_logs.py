"""vLLM's warnings that a spmdrl run cannot act on, demoted to DEBUG with the reason for each.

Building vLLM inside the trainer's process (spmdrl.rollout.vllm_engine) makes vLLM warn about choices
spmdrl made on purpose and already handles (eager mode and no chunked prefill on CPU, the in-process
engine's effect on the global RNG) and about optional pieces that have no CPU build to install (Triton).
A user reading them can do nothing, and a log where every run warns teaches users to ignore warnings.
Each one spmdrl knows is listed in :data:`KNOWN` with why it is harmless; a record that matches is
re-labelled DEBUG, not dropped: ``VLLM_LOGGING_LEVEL=DEBUG`` shows them again. Every other vLLM warning
(a new one, or one the user can act on) is printed as before; the LD_PRELOAD performance advice, which
the user can act on and every rank repeats, is printed by rank 0 only.

Matching is by the logger (vLLM's module, 0.32's layout) and the start of the formatted message; if a
vLLM release moves a message, it is shown again rather than hidden. vLLM logs some of these while it is
imported, so :func:`install` runs before the first ``import vllm``.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    """A vLLM warning spmdrl demotes: the logger that emits it, how its message starts, and why."""

    logger: str
    starts: str
    reason: str
    # The engine devices where it is demoted; elsewhere (a GPU user who chose the setting) it stays.
    devices: tuple[str, ...] = ("cpu", "cuda")
    # Advice the user can act on, the same from every rank: rank 0 keeps it, the other ranks demote it.
    keep_on_rank0: bool = False


KNOWN: tuple[Known, ...] = (
    Known(
        "vllm.engine.arg_utils",
        "The global random seed is set to",
        "spmdrl saves and restores the trainer's RNG state around the engine's build and every generate "
        "(vllm_process.isolated_rng), and each request carries its own seed",
    ),
    Known(
        "vllm.engine.arg_utils",
        "This model does not officially support disabling chunked prefill",
        "spmdrl turns chunked prefill off on CPU on purpose: a split prefill makes vLLM rewind a seeded "
        "CPU generator, which CPU generators cannot do (vllm_engine); whole prefills are vLLM's own path",
        devices=("cpu",),
    ),
    Known(
        "vllm.config.vllm",
        "Enforce eager set, disabling torch.compile",
        "spmdrl runs vLLM's CPU backend eager (it has no CUDA graphs to capture)",
        devices=("cpu",),
    ),
    Known(
        "vllm.config.vllm",
        "Inductor compilation was disabled by user settings",
        "follows from eager mode, which spmdrl sets on CPU",
        devices=("cpu",),
    ),
    Known(
        "vllm.config.vllm",
        "Model Runner V2 requires Triton",
        "vLLM's CPU backend runs the V1 model runner without Triton (rollout.model_runner chooses only "
        "on CUDA)",
        devices=("cpu",),
    ),
    Known(
        "vllm.platforms.cpu",
        "Triton is not installed. triton-cpu is expected",
        "triton-cpu publishes no wheels; vLLM's CPU kernels are its own C++ ones and do not need it",
        devices=("cpu",),
    ),
    Known(
        "vllm.triton_utils.importing",
        "Triton is installed, but doesn't include CPU backend",
        "the CUDA build of Triton (a dependency of xgrammar on x86-64 Linux) cannot run on CPU and vLLM "
        "disables it; torchrun_scripts/setup_cpu.sh removes it",
        devices=("cpu",),
    ),
    Known(
        "vllm.triton_utils.importing",
        "Triton is installed but",
        "(INFO) the same CUDA build of Triton finds no GPU driver on a CPU machine; vLLM disables it",
        devices=("cpu",),
    ),
    Known(
        "vllm.triton_utils.importing",
        "Triton not installed or not compatible",
        "(INFO) vLLM's CPU backend needs no Triton; its GPU-only functions are never called on CPU",
        devices=("cpu",),
    ),
    Known(
        "torch._library.triton",
        "Triton not available, find_triton_kernels",
        "vLLM registers Triton-backed custom ops (torch.library.triton_op) when it is imported; without "
        "Triton (a CPU install) torch notes that it cannot list their kernels; those ops never run on CPU",
        devices=("cpu",),
    ),
    Known(
        "vllm.v1.worker.cpu_worker",
        "libtcmalloc is not found in LD_PRELOAD",
        "performance advice the user can act on (preloading tcmalloc), the same on every rank: rank 0 "
        "prints it once",
        devices=("cpu",),
        keep_on_rank0=True,
    ),
    Known(
        "vllm.v1.worker.cpu_worker",
        "libiomp is not found in LD_PRELOAD",
        "performance advice the user can act on (preloading Intel OpenMP), the same on every rank: rank 0 "
        "prints it once",
        devices=("cpu",),
        keep_on_rank0=True,
    ),
    Known(
        "vllm.v1.worker.cpu_worker",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
        "vLLM's CPU worker turns torch.set_num_threads into this warning for a pinned worker process; "
        "in-process, vLLM's own later calls hit it, and spmdrl puts the function and the trainer's thread "
        "count back after the build (vllm_process.keep_thread_settings)",
        devices=("cpu",),
    ),
    Known(
        "vllm.platforms.cpu",
        "Reset SSM cache type to float32",
        "vLLM's CPU platform says it for every model on a CPU with AVX512-BF16: it concerns the state cache "
        "of Mamba / GDN layers, which the decoder families spmdrl serves do not have",
        devices=("cpu",),
    ),
    Known(
        "vllm.model_executor.models.utils",
        "Attempted to load weight",
        "the sync hands the engine the trainer's tensors in the trainer's dtype (float32 on CPU) and vLLM "
        "casts them into its own (rollout.dtype: bfloat16 on a CPU with native bf16), which is the intent; "
        "the per-step sync check compares what the engine's kernels then compute with the trainer's weights",
        devices=("cpu",),
    ),
)

# Python warnings (the warnings module, not logging) raised from vLLM's code that the user cannot act on:
# (message regex, category, module regex of the code that triggers it, reason). Ignored unless vLLM's
# logging is at DEBUG, where Python shows them as usual.
KNOWN_PY_WARNINGS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (
        r"`torch\.distributed\.reduce_op` is deprecated",
        FutureWarning,
        r"vllm\.triton_utils\.dispatcher",
        "vLLM's CPU platform scans every loaded module's attributes to patch its kernels and touches "
        "torch's deprecated alias on the way; nothing uses it",
    ),
)


class DemoteKnown(logging.Filter):
    """On one vLLM logger: a record of ``known`` becomes DEBUG (printed only if that logger is at DEBUG)."""

    def __init__(self, known: tuple[Known, ...]) -> None:
        super().__init__()
        self.starts = tuple(k.starts for k in known)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or not record.getMessage().startswith(self.starts):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        # Handler levels were not checked yet for a logger's filter, but a handler at NOTSET (the root's)
        # would print anything: decide here, by the emitting logger's own level.
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG) or debug_requested()


def install(device_type: str, rank: int = 0) -> None:
    """Demote :data:`KNOWN`'s messages for an engine on ``device_type`` on global rank ``rank`` (called again,
    it replaces the last install's filters)."""
    by_logger: dict[str, list[Known]] = {}
    for k in KNOWN:
        if device_type in k.devices and not (k.keep_on_rank0 and rank == 0):
            by_logger.setdefault(k.logger, []).append(k)
    for name in {k.logger for k in KNOWN}:
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, DemoteKnown)]:
            logger.removeFilter(f)
        if name in by_logger:
            logger.addFilter(DemoteKnown(tuple(by_logger[name])))
    if not debug_requested():
        for message, category, module, _reason in KNOWN_PY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)


def debug_requested() -> bool:
    """``VLLM_LOGGING_LEVEL=DEBUG``: the user asked for vLLM's debug output, the demoted messages included.
    Read from the environment because vLLM applies it to its loggers only when it is imported, after some
    of these messages."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG"
