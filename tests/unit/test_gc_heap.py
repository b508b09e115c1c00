"""spmdrl/gc_heap.py: the job's startup heap is frozen, vLLM's freezes and unfreezes are inert around its
build and teardown, and cyclic garbage made after the startup freeze is still collected.

Each case runs in a fresh interpreter: a freeze is process-wide and would stay in pytest's own process.
The real engine's side (its build and close leave the startup freeze as it was) is in
tests/integration/test_rollout.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> None:
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_startup_freeze_keeps_later_cyclic_garbage_collectable() -> None:
    _run(
        """
        import gc, weakref
        from spmdrl.gc_heap import freeze_startup_heap, pause_collection, skip_exit_collection

        pause_collection()
        assert not gc.isenabled()
        import json, email.mime.text  # what a program imports while collection is paused
        frozen = freeze_startup_heap()
        assert gc.isenabled() and frozen == gc.get_freeze_count() > 1000, frozen

        class Model:  # a model holds itself through its hooks: a reference cycle
            def __init__(self):
                self.me = self
        model = Model()
        alive = weakref.ref(model)
        del model
        gc.collect()
        assert alive() is None, "cyclic garbage made after the startup freeze must be collected"

        skip_exit_collection()
        assert gc.get_freeze_count() >= frozen
        print("ok")
        """
    )


def test_inert_freezes_leave_the_freeze_and_collection_as_they_were() -> None:
    _run(
        """
        import gc, weakref
        from spmdrl.gc_heap import freeze_startup_heap, inert_freezes

        frozen = freeze_startup_heap()
        class Model:
            def __init__(self):
                self.me = self
        model = Model()
        alive = weakref.ref(model)
        with inert_freezes():
            assert not gc.isenabled()
            gc.freeze()  # vLLM's freeze_gc_heap after building an engine: the model would be frozen
            assert gc.get_freeze_count() == frozen
            gc.unfreeze()  # vLLM's worker shutdown: the startup freeze would be undone
            assert gc.get_freeze_count() == frozen
        assert gc.isenabled() and gc.get_freeze_count() == frozen
        assert gc.freeze is not None and gc.freeze.__module__ == "gc"
        del model
        gc.collect()
        assert alive() is None

        # Restored when the block raises too, and collection stays off if it was off before.
        gc.disable()
        try:
            with inert_freezes():
                raise KeyError("build failed")
        except KeyError:
            pass
        assert not gc.isenabled() and gc.freeze.__module__ == gc.unfreeze.__module__ == "gc"
        gc.freeze()
        assert gc.get_freeze_count() > frozen
        print("ok")
        """
    )
