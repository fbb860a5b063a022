"""The layout keeps its layers: every import inside ``kvlog`` points down, no file imports
itself through others, no private name crosses a module, ``kvlog.util`` imports nothing of
kvlog, and no function runs past 70 lines. (The role TigerBeetle's ``tidy.zig`` plays.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvlog"
LAYERS = (
    ("kvlog.errors", "kvlog._version", "kvlog.util"),
    ("kvlog.events",),
    ("kvlog.reducers",),
    ("kvlog.log", "kvlog.executors"),
    ("kvlog.runtime",),
    ("kvlog.analysis",),
    ("kvlog.synth",),
    ("kvlog.tier",),
    ("kvlog.present",),
    ("kvlog.cli", "kvlog.integrations"),
    ("kvlog", "kvlog.__main__"),
)
MAX_FUNCTION_LINES = 70


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def unit(module: str) -> tuple[int, str]:
    """(layer, the package that is one unit of it) of a kvlog module."""
    best = max(
        (prefix for row in LAYERS for prefix in row if module == prefix or
         module.startswith(prefix + ".")),
        key=len,
    )  # fmt: skip
    return next(i for i, row in enumerate(LAYERS) if best in row), best


def imports(name: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported kvlog module, names taken from it) of every import in a module, the
    ones inside functions and ``TYPE_CHECKING`` blocks included."""
    found = []
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("kvlog")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))  # fmt: skip
            if not base.startswith("kvlog"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:
                    found.append((node.lineno, sub, []))
                else:
                    found.append((node.lineno, base, [alias.name]))
    return found


def test_every_import_points_down() -> None:
    upward = []
    for name in MODULES:
        layer, package = unit(name)
        for line, target, _ in imports(name):
            if target not in MODULES:
                continue
            to_layer, to_package = unit(target)
            if to_layer > layer or (to_layer == layer and to_package != package):
                upward.append(f"{name}:{line} -> {target}")
    assert upward == []


def test_no_file_circles() -> None:
    graph = {n: {t for _, t, _ in imports(n) if t in MODULES and t != n} for n in MODULES}
    # a package's __init__ re-exporting its own modules is not a circle of files
    for n in graph:
        if MODULES[n].name == "__init__.py":
            graph[n] = {t for t in graph[n] if not t.startswith(n + ".")}
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert circles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def test_no_private_name_crosses_a_module() -> None:
    crossing = [
        f"{name}:{line} takes {n} from {target}"
        for name in MODULES
        for line, target, names in imports(name)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert crossing == []


def test_util_imports_nothing_of_kvlog() -> None:
    util = [n for n in MODULES if unit(n)[1] == "kvlog.util"]
    assert util, "kvlog.util is missing"
    assert [(n, t) for n in util for _, t, _ in imports(n)] == []


def test_no_function_runs_past_70_lines() -> None:
    long = [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_layers_name_every_package() -> None:
    """A new top-level package must be given its layer here, not fall into one by prefix."""
    named = {p for row in LAYERS for p in row}
    tops = {".".join(n.split(".")[:2]) for n in MODULES if n != "kvlog"}
    assert sorted(tops - named) == []
