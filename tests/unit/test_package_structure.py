"""The package's shape: no import circles, no oversized modules where the runtime lives.

The modules import each other without a circle (type-only imports included).

A circle means neither module can be read, tested or changed without the other; one
hidden under ``if TYPE_CHECKING:`` is still a circle for a reader. The graph is read from
the source with ``ast``: every ``import`` and ``from ... import`` statement anywhere in a
module counts, wherever it sits (top level, a function, a ``TYPE_CHECKING`` block).
"""

from __future__ import annotations

import ast
from pathlib import Path

import eventflow

PACKAGE = Path(eventflow.__file__).parent


def _modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the package."""
    found: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # ``from pkg import mod`` imports the module ``pkg.mod`` (and ``pkg`` itself).
            candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
            out.update(c for c in candidates if c in modules)
    out.discard(name)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_package_has_no_import_circles() -> None:
    circles = _circles(_graph())
    assert not circles, "modules that import each other (directly or through others):\n" + (
        "\n".join(" <-> ".join(c) for c in circles)
    )


def test_the_walk_sees_a_circle_when_there_is_one() -> None:
    # The positive control: the same walk over a graph with a type-only style back edge.
    graph = _graph()
    assert "eventflow.app" in graph["eventflow"]  # the walk reads real imports
    graph["eventflow.errors"] = {*graph["eventflow.errors"], "eventflow.app"}
    assert any("eventflow.errors" in c and "eventflow.app" in c for c in _circles(graph))


MAX_LINES = 450
"""The longest a module in ``runtime/`` or ``adapters/`` may grow: past it, a reader can no
longer hold it (STYLE.md: one module per concept, 100-400 lines)."""


def test_runtime_and_adapter_modules_stay_short() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for folder in ("runtime", "adapters")
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"
