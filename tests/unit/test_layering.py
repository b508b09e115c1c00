"""The library's packages form layers: no package imports, directly or through others, one that imports it.

A cycle between packages (algos -> rollout -> algos) means neither can be read, tested or forked without
the other. Every import counts, the ones inside functions too: a deferred import hides a cycle from
Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import spmdrl

ROOT = Path(spmdrl.__file__).parent


def _package_of(module: str) -> str | None:
    """``spmdrl.algos.kl`` -> ``algos``; top-level modules (``spmdrl.config``) are their own layer."""
    parts = module.split(".")
    if parts[0] != "spmdrl" or len(parts) < 2:
        return None
    return parts[1]


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        here = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        deps = graph.setdefault(here, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                pkg = _package_of(name)
                if pkg and pkg != here and ((ROOT / pkg).is_dir() or (ROOT / f"{pkg}.py").exists()):
                    deps.add(pkg)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_library_packages_have_no_import_cycle() -> None:
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle between spmdrl packages: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_library_never_imports_a_recipe() -> None:
    """Recipes sit on the library, not under it: a library module that imported spmdrl.recipes.* would make
    a fork of that recipe half-effective (the library would keep calling the shipped copy). The library
    reaches a recipe only by name, through the config (entry, warmstart.entry) and config_loader.import_entry."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "spmdrl.recipes" or n.startswith("spmdrl.recipes.") for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"library modules import a recipe: {sorted(set(offenders))}"
