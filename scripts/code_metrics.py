"""Figures a reviewer asks of the package's shape (issue 30), measured the same way each time.

    python scripts/code_metrics.py [PACKAGE_DIR]       # default: ringcomm/

Prints one line per figure: import cycles (function-level imports included), modules reading
the environment, modules over 900 lines, functions over 100 lines, module docstrings over 25
lines, modules at the package root, ``# fmt: skip`` lines, and private names reached across
module boundaries (``from m import _x``, ``m._x``, ``obj._x`` where ``_x`` is not defined in
the module that reaches it). The ``duplicates`` count comes from the ``duplicates`` tool.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(tree: ast.Module, mod: str, is_pkg: bool, known: set[str]) -> set[str]:
    """Every ringcomm module this module imports, wherever the import statement stands."""
    out: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != mod:
            out.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(mod, is_pkg, node)
            for alias in node.names:
                full = f"{target}.{alias.name}"
                add(full if full in known else target)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def defined_private(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, assignments, attributes of self."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries, getattr names
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


# Public API spelled with a leading underscore: namedtuple's methods, os._exit, sys._getframe.
NOT_PRIVATE = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe"}


def private_reaches(tree: ast.Module, path: str) -> list[str]:
    own = defined_private(tree) | NOT_PRIVATE
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [
                f"{path}:{node.lineno} from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
        elif isinstance(node, ast.Attribute):
            attr = node.attr
            if attr.startswith("_") and not attr.startswith("__") and attr not in own:
                found.append(f"{path}:{node.lineno} .{attr}")
    return found


def docstring_lines(tree: ast.Module) -> int:
    doc = ast.get_docstring(tree, clean=False)
    return 0 if doc is None else doc.count("\n") + 1


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "ringcomm").resolve()
    files = sorted(root.rglob("*.py"))
    trees = {p: ast.parse(p.read_text(), str(p)) for p in files}
    names = {p: module_name(root, p) for p in files}
    known = set(names.values())
    graph = {
        names[p]: imports_of(t, names[p], p.name == "__init__.py", known) for p, t in trees.items()
    }
    rel = {p: str(p.relative_to(root.parent)) for p in files}
    cyc = cycles(graph)
    environ = [
        rel[p]
        for p in files
        if "os.environ" in p.read_text() or "getenv" in p.read_text() or "environ[" in p.read_text()
    ]
    lines = {p: p.read_text().count("\n") for p in files}
    big = [f"{rel[p]} ({n})" for p, n in lines.items() if n > 900]
    long_fns = [
        f"{rel[p]}:{node.name} ({node.end_lineno - node.lineno + 1})"
        for p, t in trees.items()
        for node in ast.walk(t)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 100
    ]
    docs = [f"{rel[p]} ({docstring_lines(t)})" for p, t in trees.items() if docstring_lines(t) > 25]
    root_mods = [p.name for p in files if p.parent == root]
    fmt_skip = sum(p.read_text().count("# fmt: skip") for p in files)
    reaches = [r for p, t in trees.items() for r in private_reaches(t, rel[p])]
    print(f"modules: {len(files)}, lines: {sum(lines.values())}")
    print(f"import cycles (function-level imports included): {len(cyc)} {cyc}")
    print(f"modules reading the environment: {len(environ)} {environ}")
    print(f"modules over 900 lines: {len(big)} {big}")
    print(f"functions over 100 lines: {len(long_fns)} {long_fns}")
    print(f"module docstrings over 25 lines: {len(docs)} {docs}")
    print(f"modules at the package root: {len(root_mods)} {root_mods}")
    print(f"'# fmt: skip' lines: {fmt_skip}")
    print(f"private names reached across modules: {len(reaches)}")
    for r in reaches[:40]:
        print("   ", r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
