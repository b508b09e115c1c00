"""A model directory in a shared cache, built once: by one process under a file lock, into a temporary
directory renamed into place, so that a reader finds it complete or not at all.

Every rank of a job (and every job on a node) may ask at once; one builds, the others wait on the lock
and then use what it renamed. The built-in tiny models (spmdrl.models.tiny) and the packaged checkpoints
(spmdrl.models.packaged) both come from here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def build_once(target: Path, build: Callable[[Path], None], required: tuple[str, ...], what: str) -> Path:
    """``target``, made by ``build(tmp_dir)`` unless it already holds every file of ``required``. ``what``:
    the model, for the log line and the message about an incomplete directory (refused, not built over)."""
    if not missing_files(target, required):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        # One builder at a time; the others wait here, then find the finished directory.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            missing = missing_files(target, required)
            if missing:
                raise RuntimeError(
                    f"the {what} directory {target} is incomplete (missing {', '.join(missing)}); delete it "
                    "and it will be built again"
                )
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        tmp.chmod(0o755)  # mkdtemp makes it private; the renamed directory should be readable
        try:
            log.info("building %s into %s", what, target)
            build(tmp)
            for f in tmp.iterdir():  # safetensors writes 0600: a shared cache must be readable
                if f.is_file():
                    f.chmod(0o644)
            try:
                os.replace(tmp, target)
            except OSError:
                # Another machine sharing this cache (where flock may not reach) renamed first: use theirs.
                if not missing_files(target, required):
                    return target
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return target


def missing_files(directory: Path, required: tuple[str, ...]) -> list[str]:
    return [f for f in required if not (directory / f).is_file()]
