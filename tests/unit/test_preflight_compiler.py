"""model.compile's preflight: a run that would compile checks for a C++ compiler before anything starts
(inductor needs one; without it the first forward failed after the engine was built). The PATH and CXX are
set per test to real directories: one holding an executable named g++, one empty."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from spmdrl.config import Config, ConfigError
from spmdrl.preflight import check_cxx_compiler, check_inputs


def _fake_compiler(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_compiler_on_the_path_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gxx = _fake_compiler(tmp_path, "g++")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert str(gxx) in check_cxx_compiler()


def test_no_compiler_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(
        ConfigError, match=r"model.compile=true needs a C\+\+ compiler.*apt-get install g\+\+"
    ):
        check_cxx_compiler()


def test_cxx_names_the_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_compiler(tmp_path, "g++")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", "my-cxx")  # set, but not on the PATH: g++ is not a fallback
    with pytest.raises(ConfigError, match="CXX='my-cxx' is not on the PATH"):
        check_cxx_compiler()
    _fake_compiler(tmp_path, "my-cxx")
    assert "my-cxx" in check_cxx_compiler()


def test_only_a_compiling_run_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, train_files=["tiny:train"], val_files=[])
    )
    check_inputs(cfg)  # model.compile=false: no compiler needed
    with pytest.raises(ConfigError, match="model.compile"):
        check_inputs(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=True)))
