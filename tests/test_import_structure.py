"""Packages point one way: no import circle among the modules of jaxft (nor of kernels_pallas, bridge), and no
function-local import of a project module in jaxft (one that dodges a circle hides the circle; function-level
imports count as edges here all the same).

Pure `ast`: nothing is imported, so the check runs in well under a second."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("jaxft", "kernels_pallas", "bridge")  # packages whose modules count as project modules

# Function-local imports of project modules that stay, each with why (keep this list short; ideally empty).
LOCAL_IMPORT_ALLOWLIST: dict[tuple[str, str], str] = {}
# Package edges (module -> a package whose __init__ its import runs) that may close a circle, each with why.
PACKAGE_EDGE_ALLOWLIST: dict[tuple[str, str], str] = {
    ("jaxft.run", "jaxft.train"): "jaxft.run builds on jaxft.train's step and optim modules, and the package "
    "re-exports train() (jaxft.train.loop, which makes a Run); the loop binds jaxft.run as a module, so either loads "
    "first",
}


def _modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a package is named by its __init__)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


ALL = {name: path for package in PROJECT for name, path in _modules(package).items()}


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported project module, line, whether inside a function) for every import in `module`'s file. `from a
    import b` names module `a.b` when that is a module, else `a`; relative imports are resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, local) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append((sub if sub in ALL else base, child.lineno, local))
            visit(child, inner)

    visit(tree, False)
    return [(name, line, local) for name, line, local in found if name.split(".")[0] in PROJECT and name in ALL]


def _graph(package: str) -> dict[str, set[str]]:
    return {m: {name for name, _, _ in _imports(m, p) if name != m and name.split(".")[0] == package}
            for m, p in _modules(package).items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, sccs, counter = {}, {}, [], set(), [], [0]

    def strongconnect(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    if len(scc) > 1:
                        sccs.append(scc)

    for node in sorted(graph):
        if node not in index:
            strongconnect(node)
    cycles = []
    for scc in sccs:  # a shortest path back to the start, within the component
        members, start = set(scc), min(scc)
        paths, seen, cycle = [[start]], {start}, None
        while paths and cycle is None:
            path = paths.pop(0)
            for child in sorted(graph[path[-1]] & members):
                if child == start:
                    cycle = [*path, start]
                    break
                if child not in seen:
                    seen.add(child)
                    paths.append([*path, child])
        cycles.append(cycle + [f"(component: {', '.join(sorted(scc))})"])
    return cycles


def test_no_import_cycles():
    for package in PROJECT:
        cycles = _cycles(_graph(package))
        assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _package_graph(package: str) -> dict[str, set[str]]:
    """The module graph plus, for every import of `a.b.c`, an edge to each package above it whose __init__ the
    import runs (`a.b`; not the top package, which every import runs, nor a package holding the importer, which
    is already loading): such a circle fails at import time in one order although no two modules name each other."""
    graph = _graph(package)
    out = {m: set(v) for m, v in graph.items()}
    for module, targets in graph.items():
        for target in targets:
            parts = target.split(".")
            for i in range(2, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg in graph and not (module + ".").startswith(pkg + ".") \
                        and (module, pkg) not in PACKAGE_EDGE_ALLOWLIST:
                    out[module].add(pkg)
    return out


def test_no_package_import_cycles():
    for package in PROJECT:
        cycles = _cycles(_package_graph(package))
        assert not cycles, ("import cycles through package __init__ modules:\n"
                            + "\n".join(" -> ".join(c) for c in cycles))


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a", "(component: a, b, c)"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_function_local_project_imports():
    bad = []
    for module, path in _modules("jaxft").items():
        for name, line, local in sorted(set(_imports(module, path))):
            if local and (module, name) not in LOCAL_IMPORT_ALLOWLIST:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {name} inside a function")
    assert not bad, "function-local imports of project modules (import at the top, or allowlist with why):\n" + \
        "\n".join(bad)
