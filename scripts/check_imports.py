"""Check the package's import graph: no cycle among its modules, no private name imported across modules.

    python scripts/check_imports.py                 # checks workbench/ next to this script
    python scripts/check_imports.py path/to/pkg     # any package directory

Every ``.py`` file under the package is parsed with ``ast`` (nothing is imported or run). Every import
statement counts, wherever it stands: at module level, inside a function or method (a lazy import
still ties the two modules together, it only defers the tie to run time), and under
``if TYPE_CHECKING:``. ``from . import x`` counts as importing the submodule ``x`` when there is
one, else the package. An edge goes from the importing module to the imported one; importing
``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but only the named module counts, since the
packages' ``__init__`` files are where re-exports live.

Problems reported, one line each, and exit status 1 when there is any:
- ``cycle: a -> b -> a``: a strongly connected set of modules, shown as one cycle through it;
- ``private: a imports _name from b``: a name starting with one underscore imported from another
  module of the package (dunder names such as ``__version__`` are not private).
A package's own ``__init__`` importing its submodules (and those importing names from their
package's ``__init__``) is a cycle like any other and is reported.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file under the package directory ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) import from ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """``(imported module, name imported from it or None)`` for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, None))
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in modules:  # `from . import x`: the submodule x
                    found.append((sub, None))
                else:
                    found.append((mod, alias.name))
    return [(m, n) for m, n in found if m in modules]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected set of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few hundred nodes, recursion is fine
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph.get(v, ()):
                sccs.append(sorted(scc))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, scc) for scc in sorted(sccs)]


def _cycle_in(graph: dict[str, set[str]], scc: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected set (breadth-first inside it)."""
    members, start = set(scc), scc[0]
    prev: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in members and w not in prev:
                prev[w] = v
                queue.append(w)
    return [start, start]


def check(root: str | Path) -> list[str]:
    """Every problem in the package at ``root``, one line each (empty when there is none)."""
    root = Path(root)
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    problems = []
    for name, path in modules.items():
        for target, imported in imports_of(name, path, modules):
            if target != name:
                graph[name].add(target)
            if imported and imported.startswith("_") and not imported.startswith("__") and target != name:
                problems.append(f"private: {name} imports {imported} from {target}")
    problems = sorted(set(problems))
    return [f"cycle: {' -> '.join(c)}" for c in find_cycles(graph)] + problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "workbench"
    if not (root / "__init__.py").is_file():
        print(f"'{root}' is not a package directory (no __init__.py)")
        return 2
    problems = check(root)
    for line in problems:
        print(line)
    if not problems:
        print(f"{root.name}: {len(module_names(root))} modules, no import cycle, no private name imported")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
