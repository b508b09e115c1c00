"""spmdrl/rollout/vllm_logs.py: vLLM's known warnings are demoted to DEBUG (not dropped), others are not."""

from __future__ import annotations

import importlib.util
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from spmdrl.rollout import vllm_logs
from spmdrl.rollout.vllm_logs import KNOWN, KNOWN_PY_WARNINGS, DemoteKnown


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Capture]:
    """A handler on each logger of KNOWN (as vLLM's own handler sits on its "vllm" logger), the loggers at
    WARNING; the filters, levels and handlers put back afterwards."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    handler = _Capture()
    names = {k.logger for k in KNOWN}
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in names}
    for n in names:
        logging.getLogger(n).addHandler(handler)
        logging.getLogger(n).setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        for n, (level, filters) in saved.items():
            logger = logging.getLogger(n)
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.filters[:] = filters


def _message(k: vllm_logs.Known) -> str:
    return k.starts + " (the rest of vLLM's message)"


def test_every_known_message_is_demoted_on_cpu_and_an_unknown_warning_is_not(captured: _Capture) -> None:
    vllm_logs.install("cpu", rank=1)
    for k in KNOWN:
        logging.getLogger(k.logger).warning(_message(k))
    assert captured.records == []
    logging.getLogger("vllm.v1.worker.cpu_worker").warning("Something new happened: check your settings")
    logging.getLogger("vllm.engine.arg_utils").warning("The global random state ... (not the known start)")
    assert [(r.levelname, r.getMessage()[:20]) for r in captured.records] == [
        ("WARNING", "Something new happen"),
        ("WARNING", "The global random st"),
    ]


def test_demoted_not_dropped_a_debug_logger_shows_them_as_debug(captured: _Capture) -> None:
    vllm_logs.install("cpu", rank=1)
    for k in KNOWN:
        logging.getLogger(k.logger).setLevel(logging.DEBUG)
        logging.getLogger(k.logger).warning(_message(k))
    assert [r.getMessage() for r in captured.records] == [_message(k) for k in KNOWN]
    assert {r.levelname for r in captured.records} == {"DEBUG"}


def test_vllm_logging_level_debug_shows_them(captured: _Capture, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_LOGGING_LEVEL=DEBUG: shown even on a logger vLLM has not configured yet (import-time warnings)."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    vllm_logs.install("cpu", rank=1)
    for k in KNOWN:
        logging.getLogger(k.logger).warning(_message(k))
    assert len(captured.records) == len(KNOWN) and {r.levelno for r in captured.records} == {logging.DEBUG}


def test_on_cuda_only_the_device_independent_ones_are_demoted(captured: _Capture) -> None:
    """A GPU user who sets rollout.enforce_eager=true still reads vLLM's note on what it costs."""
    vllm_logs.install("cuda", rank=0)
    for k in KNOWN:
        logging.getLogger(k.logger).warning(_message(k))
    shown = [r.getMessage() for r in captured.records]
    assert shown == [_message(k) for k in KNOWN if "cuda" not in k.devices]
    assert any("Enforce eager" in m for m in shown)


def test_advice_the_user_can_act_on_is_printed_once_by_rank_0(captured: _Capture) -> None:
    actionable = [k for k in KNOWN if k.keep_on_rank0]
    assert {k.starts.split()[0] for k in actionable} == {"libtcmalloc", "libiomp"}
    for rank, expected in ((0, len(actionable)), (1, 0)):
        captured.records.clear()
        vllm_logs.install("cpu", rank=rank)  # again: replaces the last install's filters
        for k in KNOWN:
            logging.getLogger(k.logger).warning(_message(k))
        assert len(captured.records) == expected
        assert sum(isinstance(f, DemoteKnown) for f in logging.getLogger(actionable[0].logger).filters) == 1


def test_the_python_warning_is_ignored_unless_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    (message, category, module, _reason), *_ = KNOWN_PY_WARNINGS
    text = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
    for level, shown in (("", 0), ("DEBUG", 1)):
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", level)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            vllm_logs.install("cpu")
            warnings.warn_explicit(
                text, category, "dispatcher.py", 138, module="vllm.triton_utils.dispatcher"
            )
            warnings.warn_explicit(text, category, "mine.py", 1, module="mine")  # not vLLM's: shown
        assert len(seen) == 1 + shown, [str(w.message) for w in seen]


def test_every_known_message_is_in_the_installed_vllm_where_the_table_says() -> None:
    """The table names vLLM's (and torch's) modules and message starts: a release that moves or rewords one
    fails here, instead of its warning quietly coming back (or a stale entry staying)."""
    vllm = importlib.util.find_spec("vllm")
    if vllm is None or not vllm.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    roots = {"vllm": Path(next(iter(vllm.submodule_search_locations))).parent}
    torch_spec = importlib.util.find_spec("torch")
    assert torch_spec is not None and torch_spec.origin is not None
    roots["torch"] = Path(torch_spec.origin).parent.parent
    for k in KNOWN:
        source = (roots[k.logger.split(".")[0]] / (k.logger.replace(".", "/") + ".py")).read_text()
        joined = re.sub(r'"\s*\n\s*"', "", source)  # adjacent string literals, as Python joins them
        # "libtcmalloc is not found ...": vLLM formats the library's name into "%s is not found ...".
        head, _, rest = k.starts.partition(" ")
        templated = f'"{head}"' in joined and f"%s {rest}" in joined
        assert k.starts in joined or templated, f"{k.logger}: no message starting {k.starts!r}"
