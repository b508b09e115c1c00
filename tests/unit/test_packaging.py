"""pyproject.toml against the code and the environment: every third-party package spmdrl (or a recipe)
imports is declared, as a dependency or in an extra; the installed releases satisfy the declared bounds;
every package directory is listed for the wheel."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("spmdrl", "recipes")
# Under spmdrl/: links to recipes/ and configs/ that a checkout may have for editable runs; scanned once,
# as recipes/.
LINKS = ("spmdrl/recipes", "spmdrl/configs")

# Import names whose distribution has another name, for when the package is not installed here (the
# installed ones are looked up in their metadata).
DIST_OF_IMPORT = {
    "yaml": "PyYAML",
    "hydra": "hydra-core",
    "math_verify": "math-verify",
    "mlflow": "mlflow-skinny",
    "vllm": "vllm",
    "flash_attn": "flash-attn",
}
# Imported, not declared, on purpose: each import is guarded and its absence handled.
NOT_DECLARED = {
    # The CUDA varlen kernel used when it imports (spmdrl.models.varlen); it is built for the user's own
    # torch and CUDA, which no pin here could match.
    "flash-attn",
}


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _requirements() -> dict[str, list[Requirement]]:
    """The declared requirements by where they are declared: "" for the dependencies, else the extra."""
    project = _pyproject()["project"]
    out = {"": [Requirement(d) for d in project["dependencies"]]}
    for extra, deps in project["optional-dependencies"].items():
        out[extra] = [Requirement(d) for d in deps]
    return out


def _python_files() -> list[Path]:
    files = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not any(rel.startswith(link + "/") for link in LINKS):
                files.append(path)
    return files


@functools.cache
def _third_party_imports() -> dict[str, set[str]]:
    """Top-level import name -> the files importing it, absolute imports outside the standard library and
    spmdrl (wherever they are: module level, in a function, under try)."""
    found: dict[str, set[str]] = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "spmdrl":
                    found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


@functools.cache
def _installed_distributions() -> dict[str, list[str]]:
    """Import name -> distributions: one scan of every installed distribution's files (seconds), so once."""
    return dict(metadata.packages_distributions())


def _distribution(import_name: str) -> str:
    installed = _installed_distributions().get(import_name)
    if installed:
        return installed[0]
    return DIST_OF_IMPORT.get(import_name, import_name)


def test_the_scan_sees_the_imports() -> None:
    """The scan itself: the imports it must find, so an empty result cannot pass the test below."""
    found = _third_party_imports()
    assert {"torch", "transformers", "yaml", "matplotlib", "vllm"} <= set(found), sorted(found)
    assert "spmdrl/logging/plot.py" in found["matplotlib"]


def test_every_imported_package_is_declared() -> None:
    declared = {canonicalize_name(r.name) for reqs in _requirements().values() for r in reqs}
    missing = {}
    for name, files in sorted(_third_party_imports().items()):
        dist = canonicalize_name(_distribution(name))
        if dist not in declared and dist not in {canonicalize_name(d) for d in NOT_DECLARED}:
            missing[f"{name} (distribution {dist})"] = sorted(files)
    assert not missing, (
        f"imported but not declared in pyproject.toml: {missing}; add each to [project] dependencies, or to "
        "an extra when its import is optional (guarded, with a message that names the extra)"
    )


def test_installed_versions_satisfy_the_declared_bounds() -> None:
    """The dependencies must be installed and in range; an extra's package is checked where installed."""
    bad = []
    for extra, reqs in _requirements().items():
        for req in reqs:
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                if extra == "":
                    bad.append(f"{req}: not installed")
                continue
            if not req.specifier.contains(version, prereleases=True):
                bad.append(f"{req} ({extra or 'dependencies'}): {version} is installed")
    assert not bad, bad


def test_every_package_directory_is_in_the_wheel() -> None:
    """A package missing from [tool.setuptools] packages works in an editable install and is absent from
    a built one."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "spmdrl").rglob("__init__.py")
        if not any(p.relative_to(ROOT).as_posix().startswith(link + "/") for link in LINKS)
    }
    assert on_disk <= listed, sorted(on_disk - listed)
