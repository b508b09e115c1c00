"""One rank's failure ends the whole job promptly, with the cause printed.

Without this, a rank that raises leaves its peers blocked in the next collective until the
process-group timeout (minutes). We print the traceback with the rank, record it in torchrun's
error file (so the launcher's summary names the root cause), and leave with ``os._exit`` so no
atexit hook, engine thread or process-group destructor can keep the process alive. torchrun
then sees a worker exit non-zero and stops the other workers at once.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

EXIT_FAILURE = 1


def run_or_die(fn: Callable[[], T]) -> T:
    from spmdrl.config_exit import exit_config_error
    from spmdrl.data.parquet import DataError
    from spmdrl.errors import ConfigError

    try:
        return fn()
    except (ConfigError, DataError) as e:
        # A wrong setting or data file found once the run started (the output directory holds a run, a
        # row that does not parse): the user's to fix, so it ends like one found at load, once and exit 2.
        exit_config_error(str(e), "data" if isinstance(e, DataError) else "config", in_run=True)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        _die(e)
    except BaseException as e:  # noqa: BLE001 - every failure must end the job
        _die(e)
    raise AssertionError("unreachable")


def _die(exc: BaseException) -> None:
    rank = os.environ.get("RANK", "0")
    try:
        tb = "".join(traceback.format_exception(exc))
        sys.stderr.write(f"\n[spmdrl] rank {rank} failed; ending the job.\n{tb}")
        sys.stderr.flush()
        sys.stdout.flush()
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
    finally:
        os._exit(EXIT_FAILURE)
