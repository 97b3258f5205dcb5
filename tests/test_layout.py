"""The package's layout: an import graph with no cycle, floors that import only downward, and a
front that reaches the runtime only through its interface.

The graph is read from the source (``ast``), not from an import: every ``import`` and
``from ... import`` of a dspark_ray module, at module level and inside functions (and under
``TYPE_CHECKING``), is an edge from the importing module to the module it names.
``from package import name`` names ``package.name`` when that is a module, else the package's
``__init__``; importing a submodule is not counted as importing its package.

The rules:

1. No import cycle, of any length: an arrow that runs both ways means one of the two files holds
   something that belongs to neither (give it a module of its own).
2. The floors of ``dspark_ray`` (its subpackages and top-level modules) import one another in one
   direction only: the package graph has no cycle either.
3. The OpenAI front (``dspark_ray.openai``) imports from the runtime (``dspark_ray.runtime``) only
   the modules of ``dspark_ray.runtime.INTERFACE`` (the engine loop and the runtime's errors),
   and nothing of the Serve application (``dspark_ray.serve``), which puts the two together.
4. The runtime imports neither the front nor the Serve application; the engine, the slots and the
   model import none of the three.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "dspark_ray"
FRONT, RUNTIME, APP = "dspark_ray.openai", "dspark_ray.runtime", "dspark_ray.serve"
CORE = ("dspark_ray.engine", "dspark_ray.slots", "dspark_ray.model")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}."""
    mods = modules()

    def named(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        edges: dict[str, int] = {}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                if target == "dspark_ray" or target.startswith("dspark_ray."):
                    found = named(target)
                    if found is not None and found != mod:
                        edges.setdefault(found, node.lineno)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor(module: str) -> str:
    """The subpackage or top-level module of dspark_ray that ``module`` belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2])


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"dspark_ray.engine.scheduler", "dspark_ray.openai.routes", "dspark_ray.runtime.actors",
            "dspark_ray.serve.app"} <= set(graph)
    assert "dspark_ray.runtime.engine_loop" in graph["dspark_ray.serve.server"]
    assert "dspark_ray.engine.request" in graph["dspark_ray.engine.scheduler"]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles({m: set(edges) for m, edges in graph.items()})
    lines = []
    for component in found:
        inside = set(component)
        lines.append(" <-> ".join(component) + ":")
        lines += [f"    {m} imports {t} (line {line})" for m in component for t, line in graph[m].items()
                  if t in inside]
    assert not found, "import cycles; give what both files need a module of its own:\n" + "\n".join(lines)


def test_the_floors_import_one_way():
    graph = import_graph()
    floors: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], str] = {}
    for m, edges in graph.items():
        for t, line in edges.items():
            a, b = floor(m), floor(t)
            if a != b:
                floors[a].add(b)
                why.setdefault((a, b), f"{m} imports {t} (line {line})")
    found = cycles(floors)
    lines = [" <-> ".join(c) + ": " + "; ".join(why[a, b] for a in c for b in c if (a, b) in why) for c in found]
    assert not found, "packages that import each other:\n" + "\n".join(lines)


def test_the_front_reaches_the_runtime_only_through_its_interface():
    from dspark_ray.runtime import INTERFACE

    graph = import_graph()
    assert all(m in graph for m in INTERFACE), INTERFACE
    wrong = [f"{m} imports {t} (line {line})" for m, edges in graph.items() if under(m, FRONT)
             for t, line in edges.items()
             if (under(t, RUNTIME) and t not in INTERFACE) or under(t, APP)]
    assert not wrong, (f"the OpenAI front may import only {', '.join(INTERFACE)} of the runtime and nothing of "
                       "the Serve application:\n" + "\n".join(wrong))


def test_the_lower_floors_import_no_serving_layer():
    graph = import_graph()
    rules = [(RUNTIME, (FRONT, APP))] + [(core, (RUNTIME, FRONT, APP)) for core in CORE]
    wrong = [f"{m} imports {t} (line {line})" for package, banned in rules for m, edges in graph.items()
             if under(m, package) for t, line in edges.items() if any(under(t, b) for b in banned)]
    assert not wrong, "imports running back up:\n" + "\n".join(wrong)
