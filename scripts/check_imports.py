"""Check the package's import graph: no cycle among its modules, no private name imported across modules, and
no import of a higher layer.

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
- ``layer: a (layer i) imports b (layer j)``: ``j > i``, for a package whose ``__init__`` declares
  ``__layers__``, its subpackages and root modules from the bottom up (an entry may be a tuple of names
  that share a layer). A module of a subpackage may import its own subpackage and any lower layer; the
  package's own ``__init__`` and ``__main__`` stand above every layer (the ``__init__`` re-exports);
  a module in no layer is reported as ``unplaced``.
A package's own ``__init__`` importing its submodules (and those importing names from their
package's ``__init__``) is a cycle like any other and is reported.

The summary line counts the imports among the package's modules, and how many of them stand inside a
function: those may only defer a heavy third-party package (torch, onnxruntime, an SDK) that the
imported module loads, since a cycle or a higher layer is refused either way.
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


def imports_of(name: str, path: Path, modules: dict[str, Path], *,
               with_place: bool = False) -> list[tuple]:
    """``(imported module, name imported from it or None)`` for every import in the file; with ``with_place``
    a third item says whether the import stands inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, str | None, bool]] = []
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        inner = id(node) in in_function
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, None, inner))
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in modules:  # `from . import x`: the submodule x
                    found.append((sub, None, inner))
                else:
                    found.append((mod, alias.name, inner))
    return [(m, n, f) if with_place else (m, n) for m, n, f in found if m in modules]


def declared_layers(root: Path) -> list[tuple[str, ...]] | None:
    """The package's ``__layers__`` (read with ``ast``, bottom first), each entry as a tuple of names; None if absent."""
    tree = ast.parse((root / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__layers__" for t in node.targets):
            return [tuple([e]) if isinstance(e, str) else tuple(e) for e in ast.literal_eval(node.value)]
    return None


def layer_of(module: str, package: str, layers: list[tuple[str, ...]]) -> int | None:
    """The layer index of ``module`` (its first name under the package), -1 for the package itself and its
    ``__main__`` (above every layer), None when no layer names it."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return -1
    for i, names in enumerate(layers):
        if parts[1] in names:
            return i
    return None


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
    layers = declared_layers(root)
    for name, path in modules.items():
        for target, imported in imports_of(name, path, modules):
            if target != name:
                graph[name].add(target)
            if imported and imported.startswith("_") and not imported.startswith("__") and target != name:
                problems.append(f"private: {name} imports {imported} from {target}")
        if layers is None:
            continue
        mine = layer_of(name, root.name, layers)
        if mine is None:
            problems.append(f"unplaced: {name} is in no layer of __layers__")
            continue
        for target in graph[name]:
            theirs = layer_of(target, root.name, layers)
            if mine != -1 and theirs is not None and (theirs == -1 or theirs > mine):
                problems.append(f"layer: {name} (layer {mine}) imports {target} (layer {theirs})")
    problems = sorted(set(problems))
    return [f"cycle: {' -> '.join(c)}" for c in find_cycles(graph)] + problems


def import_counts(root: str | Path) -> tuple[int, int]:
    """(imports among the package's modules, how many of them stand inside a function)."""
    root = Path(root)
    modules = module_names(root)
    places = [inner for name, path in modules.items()
              for target, _, inner in imports_of(name, path, modules, with_place=True) if target != name]
    return len(places), sum(places)


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
        total, inner = import_counts(root)
        layers = declared_layers(root)
        layered = f"{len(layers)} layers, no import of a higher layer, " if layers else ""
        print(f"{root.name}: {len(module_names(root))} modules, {layered}no import cycle, no private name imported; "
              f"{total} imports among them, {inner} inside functions")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
