"""What a job asks of Python's cyclic garbage collector.

A worker imports torch, transformers and vLLM: about 650,000 objects that the collector tracks and that
live as long as the process. Every full collection walks all of them (about 0.1 s each on one CPU core;
a short CPU job made ~2,000 collections and spent 3-7 s per rank in them), and interpreter exit walks
them once more (1.5-3 s per rank). Three measures, none of which changes what is freed while the job
runs:

- :func:`pause_collection` from the program's start, then :func:`freeze_startup_heap` once it is
  imported (``spmdrl.train`` calls both around loading the config, which imports the recipe): no
  collection runs while modules load (an import makes almost no garbage), and those objects then move to
  the permanent generation, which collections skip. Only what was alive then is frozen (modules,
  classes, the config), never a model or an engine, so cyclic garbage the job makes later is collected
  as before.
- :func:`inert_freezes` around vLLM's import, its engine build and its teardown: vLLM freezes every
  live object after building an engine (``freeze_gc_heap``, vllm/utils/gc_utils.py), the trainer's
  models included, so that cyclic garbage among them would never be collected, and its workers'
  shutdown unfreezes everything (the startup freeze too). Inside this context freeze and unfreeze do
  nothing and no collection runs.
- :func:`skip_exit_collection` at the job's end, after everything is closed and flushed: interpreter
  exit then has nothing to walk.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> int:
    """Freeze every object alive now and turn collection back on; returns the number frozen. Call it
    where what is alive lives for the whole process (after the imports), not while a model or engine
    exists that the job may drop. No collection first: it would walk the whole heap (0.4-0.8 s) to find
    the few kilobytes of garbage that imports leave."""
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


def pause_collection() -> None:
    """No automatic collection until :func:`freeze_startup_heap`."""
    gc.disable()


@contextlib.contextmanager
def inert_freezes() -> Iterator[None]:
    """``gc.freeze`` and ``gc.unfreeze`` are no-ops, and automatic collection is off, inside this block."""
    freeze, unfreeze, enabled = gc.freeze, gc.unfreeze, gc.isenabled()
    gc.freeze = gc.unfreeze = _nothing
    gc.disable()
    try:
        yield
    finally:
        gc.freeze, gc.unfreeze = freeze, unfreeze
        if enabled:
            gc.enable()


def skip_exit_collection() -> None:
    """Freeze what is left so that interpreter exit does not walk it: the last call of a finished job."""
    gc.freeze()


def _nothing() -> None:
    return None
