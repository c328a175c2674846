"""The rooms hold: layers import only downward, no module cycles, no package over 20% of code."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each package may import those before it (and itself), never one after it.
LAYERS = (
    "schemas",
    "session_model",
    "projections",
    "producers",
    "processors",
    "console",
    "milpa_sessions",
)
# Tools beside the product: the bench may use any product package; deploy uses none.
TOOLS = {"bench": set(LAYERS) | {"bench", "deploy"}, "deploy": {"deploy"}}
PACKAGES = (*LAYERS, *TOOLS)
MAX_SHARE = 0.20


def sources(package: str, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    """A package's source files, sorted. Dot directories are not walked: a local stack's state
    (deploy/.run*, CI's too) is there, and its Kafka data directories vanish while tests run."""
    found: list[Path] = []
    for directory, subdirs, files in os.walk(ROOT / package):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        found.extend(Path(directory) / f for f in files if f.endswith(suffixes))
    return sorted(found)


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the product and its tools, by dotted name."""
    for package in PACKAGES:
        for path in sources(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def imports(path: Path) -> set[str]:
    """The first-party modules a file imports (at any depth, lazily or not)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


GRAPH = {name: imports(path) for name, path in modules()}
KNOWN = set(GRAPH)


def allowed(package: str) -> set[str]:
    """The packages `package` may import."""
    if package in TOOLS:
        return TOOLS[package]
    return set(LAYERS[: LAYERS.index(package) + 1])


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_only_downward(module: str) -> None:
    """A module imports its own package and the layers below it, nothing above."""
    package = module.split(".", maxsplit=1)[0]
    upward = sorted(m for m in GRAPH[module] if m.split(".")[0] not in allowed(package))
    assert upward == [], f"{module} imports upward: {upward}"


def test_no_module_cycles() -> None:
    """No module reaches itself through its imports."""
    edges = {m: {i for i in deps if i in KNOWN and i != m} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n) :], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def code_lines(path: Path) -> int:
    """Non-blank lines of a source file."""
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def test_no_package_holds_more_than_a_fifth_of_the_code() -> None:
    """Non-blank lines of Python and Lua, tests excluded."""
    sizes = {p: sum(code_lines(f) for f in sources(p, (".py", ".lua"))) for p in PACKAGES}
    total = sum(sizes.values())
    over = {p: round(n / total, 3) for p, n in sizes.items() if n > MAX_SHARE * total}
    assert over == {}, f"of {total} lines: {over}"


def test_the_checks_see_a_violation() -> None:
    """The import scan finds lazy imports too (the checks above would miss nothing)."""
    src = ROOT / "bench" / "naive_projector.py"
    assert any(m.startswith("projections.") for m in imports(src))


@pytest.mark.parametrize("package", LAYERS)
def test_each_package_says_what_it_holds_and_what_it_may_import(package: str) -> None:
    """The package docstring names exactly the layers below it under "May import:"."""
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())) or ""
    assert "Holds:" in doc
    assert "May import:" in doc
    said = doc.split("May import:", 1)[1]
    below = set(LAYERS[: LAYERS.index(package)])
    if "every package" in said:
        assert below == set(LAYERS[:-1])
    else:
        assert {p for p in LAYERS if f"`{p}`" in said} == below
