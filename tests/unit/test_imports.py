"""The package's layering, read from the source (ast, nothing imported or executed): every
import counts, at module level, inside functions and under TYPE_CHECKING alike.

- the runtime takes from the planner only `mmpipe.planner.api`;
- the data pipeline imports nothing of the planner;
- the planner is pure: no runtime, data, config/CLI, torch, DeepSpeed or Hydra;
- no two modules import each other, directly or through others;
- no private name (`_x`) crosses a module boundary.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mmpipe"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Every module `path` imports: `from a.b import c` counts as a.b.c when that is a module of
    the package, else as a.b; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return out


FILES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: _imports(path, name, set(FILES)) for name, path in FILES.items()}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _offenders(importers: str, allowed, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} imports {dep}" for m, deps in GRAPH.items() if _within(m, importers)
                  for dep in deps if any(_within(dep, f) for f in forbidden) and not allowed(dep))


def test_the_walk_sees_the_package():
    assert len(GRAPH) > 40
    assert "mmpipe.planner.api" in GRAPH["mmpipe.runtime.feed"]
    assert "mmpipe.model.layers" in GRAPH["mmpipe.runtime.stages"]  # an import inside a function


def test_runtime_takes_only_the_planner_api():
    assert _offenders("mmpipe.runtime", lambda dep: dep == "mmpipe.planner.api", ("mmpipe.planner",)) == []


def test_data_does_not_import_the_planner():
    assert _offenders("mmpipe.data", lambda dep: False, ("mmpipe.planner",)) == []


def test_planner_is_pure():
    forbidden = ("mmpipe.runtime", "mmpipe.data", "mmpipe.config", "mmpipe.cli", "torch", "deepspeed",
                 "hydra", "omegaconf")
    assert _offenders("mmpipe.planner", lambda dep: False, forbidden) == []


def test_no_private_name_crosses_a_module():
    found = sorted(f"{name} imports {node.module}.{alias.name}" for name, path in FILES.items()
                   for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                   for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__"))
    assert found == []


def test_no_import_cycles():
    cycles = _cycles({m: {d for d in deps if d in GRAPH} for m, deps in GRAPH.items()})
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself),
    each listed with one cycle through it (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            for dep in deps:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph[dep]))))
                    break
                if dep in on_stack:
                    low[node] = min(low[node], index[dep])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1 or node in graph[node]:
                        found.append(_one_cycle(graph, set(comp)))
    return found


def _one_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A path from the component's first module back to itself, inside the component."""
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for dep in sorted(graph[m] & comp):
                if dep == start:
                    return paths[m] + [start]
                if dep not in paths:
                    paths[dep] = paths[m] + [dep]
                    nxt.append(dep)
        frontier = nxt
    return sorted(comp)


def _part(module: str) -> str:
    """A module's part on the floors: its top-level file or subpackage (`mmpipe.runtime.feed` ->
    `runtime/`, `mmpipe.cli` -> `cli.py`, `mmpipe` -> `__init__.py`)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def _documented_floors() -> dict[str, int]:
    """docs/architecture.md's floor table: part -> floor (a row may run over to the next line,
    indented under the first part)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("## Floors", 1)[1].split("```", 2)[1]
    floors: dict[str, int] = {}
    floor = None
    for line in block.splitlines():
        m = re.match(r"^(?:floor (\d+))?\s+(\S.*?)(?:\s{2,}|$)", line)
        if not line.strip() or m is None:
            continue
        if m.group(1) is not None:
            floor = int(m.group(1))
        elif not re.match(r"^\s{9}\S", line):  # a description's second line, not more parts
            continue
        for part in re.findall(r"[\w.]+(?:/|\.py)", m.group(2)):
            floors[part] = floor
    return floors


def test_the_documented_floors_are_the_imports():
    """Every part of the package sits on a floor of docs/architecture.md and imports only from
    lower floors: the drawing cannot go stale."""
    floors = _documented_floors()
    parts = {_part(m) for m in GRAPH}
    assert sorted(parts - set(floors)) == []  # every part is drawn
    assert sorted(set(floors) - parts) == []  # nothing drawn that is not there
    upward = sorted(f"{_part(m)} (floor {floors[_part(m)]}) imports {_part(d)} (floor {floors[_part(d)]})"
                    for m, deps in GRAPH.items() for d in deps
                    if d.startswith("mmpipe") and _part(d) != _part(m) and floors[_part(d)] >= floors[_part(m)])
    assert upward == []
