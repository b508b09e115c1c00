"""How a configuration or data error ends the program: its message once for the whole job, as the last
thing the user sees, and exit code 2.

Exit codes: 0 done, 1 a failure while running (spmdrl.distributed.failure), 2 a configuration or data
error found before the run started. torchrun exits 1 whenever a worker fails, whatever its code, so the 2
reaches the shell only from ``python -m spmdrl.train --check`` (or a plain ``python -m spmdrl.train``).

Under torchrun the message goes into the worker's error file (``TORCHELASTIC_ERROR_FILE``), not to stderr:
torchrun's closing summary prints the root cause's error file as its last lines, where without one it
prints a link to PyTorch's docs, and the message printed 30 lines above it was easy to miss. The file is
written here in the format of torch.distributed.elastic's ErrorHandler (a JSON ``message`` whose
``extraInfo.py_callstack`` the summary prints), without importing torch: a config typo must not cost
torch's import time.

Once: every rank reads the same config and fails the same way, so rank 0 reports at once and the other
ranks wait before reporting. torchrun stops the job when the first worker exits, so rank 0's report is the
one it prints; a rank that exited first could get rank 0 killed before it reported (the message was lost,
intermittently). A rank still alive after its wait (its cause was its own: a file only its node lacks)
reports and exits itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

EXIT_CONFIG_ERROR = 2

# A rank other than 0 waits this long, or as long as it took to get here if that is longer (rank 0 does the
# same work, so it takes about as long, however loaded the machine), before it reports.
_MIN_NONZERO_RANK_DELAY_S = 5.0
_STARTED = time.monotonic()


def exit_config_error(message: str, kind: str = "config", *, in_run: bool = False) -> NoReturn:
    """Reports ``message`` (``spmdrl: config error: ...``, or ``data error`` with ``kind="data"``: a data
    file that does not read or fit) once for the job and exits 2. ``in_run``: raised inside a run (a process
    group and its threads alive), which ends without the interpreter's teardown."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(max(_MIN_NONZERO_RANK_DELAY_S, time.monotonic() - _STARTED))
    text = f"spmdrl: {kind} error: {message}"
    if not _write_error_file(text):
        sys.stderr.write(text + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    if in_run:
        # os._exit, as spmdrl.distributed.failure ends any failed rank: the interpreter's teardown with a
        # live process group and its threads can crash (a SIGSEGV was seen), and torchrun then reports -11
        # instead of 2. Nothing needs the teardown: what matters is written and flushed above, and
        # checkpoints are published atomically.
        os._exit(EXIT_CONFIG_ERROR)
    sys.exit(EXIT_CONFIG_ERROR)


def _write_error_file(text: str) -> bool:
    """Writes ``text`` as this worker's torchelastic error file; False when there is none (not under
    torchrun) or it cannot be written (the caller prints instead)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {
        "message": {
            "message": text,
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True
