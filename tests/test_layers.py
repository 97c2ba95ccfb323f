"""Imports point down the layers the README's layout section states, and no two packages
import each other, directly or around a circle.

The imports are read from the source with :mod:`ast` (torch is never imported), every one
of them: at the top of a module, inside a function (a lazy import is still a dependency)
and under ``TYPE_CHECKING``. ``python tests/test_layers.py [ROOT]`` prints the report for
a checkout: each upward import and each circle, and the module count and largest module.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The README's layers, bottom first; a unit is a subpackage of tplib or a module at its
# root. A unit may import its own layer's units and those below; a circle is refused
# whatever the layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("util",),
    ("plan", "documents", "packing"),
    ("schedule",),
    ("nn",),
    ("paper", "published"),
    ("sim",),
    ("planner", "cluster"),
    ("runtime",),
    ("perfmodel",),
    ("partition",),
    ("search",),
    ("runs",),
    ("measure", "gpucheck"),
    ("tables",),
    ("explorer", "reproduce"),
    ("cli",),
    ("__init__", "__main__"),
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(root: Path) -> Iterator[tuple[str, str]]:
    """Every (importing module, imported tplib module) pair under ``root/tplib``."""
    for path in sorted((root / "tplib").rglob("*.py")):
        module = _module(path, root)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # `from tplib import x` names a module x or a name of tplib/__init__;
                # `from tplib.tables import findings` names the module findings.
                targets = [
                    f"{base}.{a.name}"
                    if base == "tplib" or _is_module(f"{base}.{a.name}", root)
                    else base
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                if target == "tplib" or target.startswith("tplib."):
                    yield module, target


def unit(module: str, root: Path) -> str:
    """The layer unit of a dotted module: its subpackage, or its root module's name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    if (root / "tplib" / parts[1]).is_dir() or (root / "tplib" / f"{parts[1]}.py").exists():
        return parts[1]
    return "__init__"  # a name defined in tplib/__init__


def unit_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for source, target in imports(root):
        a, b = unit(source, root), unit(target, root)
        graph.setdefault(a, set())
        if a != b:
            graph[a].add(b)
    return graph


def upward(root: Path, layer: Mapping[str, int] = LAYER) -> list[str]:
    """Each import of a higher layer's module, as 'importer -> imported'."""
    found = []
    for source, target in imports(root):
        a, b = unit(source, root), unit(target, root)
        if a in layer and b in layer and layer[a] < layer[b]:
            found.append(f"{source} -> {target}")
    return sorted(set(found))


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def module_graph(root: Path) -> dict[str, set[str]]:
    """The imports between the modules of each subpackage, its ``__init__`` standing for
    the package: a module importing a name of its own package's ``__init__`` closes a
    circle with it."""
    graph: dict[str, set[str]] = {}
    for source, target in imports(root):
        if not _is_module(target, root):
            continue
        home = source if _is_module(f"{source}.__init__", root) else source.rpartition(".")[0]
        there = target if _is_module(f"{target}.__init__", root) else target.rpartition(".")[0]
        if home == there != "tplib" and source != target:
            graph.setdefault(source, set()).add(target)
    return graph


def unlayered(root: Path) -> list[str]:
    return sorted(set(unit_graph(root)) - set(LAYER))


def test_every_unit_has_a_layer() -> None:
    assert unlayered(ROOT) == [], "add the new package to LAYERS here and in the README"


def test_imports_point_down() -> None:
    assert upward(ROOT) == []


def test_no_circle_between_packages() -> None:
    assert circles(unit_graph(ROOT)) == []


def test_no_circle_between_the_modules_of_a_package() -> None:
    assert circles(module_graph(ROOT)) == []


def test_the_readme_states_the_same_layers() -> None:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Layers") :].split("\n\n")[2]
    stated = [
        tuple(re.findall(r"`tplib/(\w+)(?:/|\.py)`", line) or ["__init__", "__main__"])
        for line in re.findall(r"^\d+\. (.+)$", section, flags=re.M)
    ]
    assert stated == list(LAYERS)


def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path: Path) -> None:
    for name, body in {
        "__init__.py": "",
        "plan.py": "from tplib.schedule.actions import Action\n",
        "schedule/__init__.py": "",
        "schedule/actions.py": "def f():\n    from tplib.plan import Plan\n",
        "schedule/drawing.py": "from tplib.schedule import actions\n",
        "schedule/engine.py": "def g():\n    from tplib.schedule.drawing import h\n",
        "schedule/validate.py": "from tplib.schedule.engine import run\n",
        "tables/__init__.py": "from tplib.tables.base import Table\n",
        "tables/base.py": "from tplib.tables import MODES\n",
    }.items():
        (tmp_path / "tplib" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tplib" / name).write_text(body)
    assert upward(tmp_path) == ["tplib.plan -> tplib.schedule.actions"]
    assert circles(unit_graph(tmp_path)) == [["plan", "schedule"]]
    assert circles(module_graph(tmp_path)) == [["tplib.tables", "tplib.tables.base"]]
    (tmp_path / "tplib/schedule/actions.py").write_text("from tplib.schedule.validate import v\n")
    assert circles(module_graph(tmp_path))[0] == [
        "tplib.schedule.actions",
        "tplib.schedule.drawing",
        "tplib.schedule.engine",
        "tplib.schedule.validate",
    ]


def report(root: Path) -> str:
    modules = sorted((root / "tplib").rglob("*.py"))
    sizes = sorted((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in modules)
    up = upward(root)
    rings = circles(unit_graph(root))
    lines = [f"upward imports: {len(up)}", *(f"  {u}" for u in up)]
    lines += [f"circles between packages: {len(rings)}", *(f"  {' <-> '.join(c)}" for c in rings)]
    rings = circles(module_graph(root))
    lines += [f"circles inside packages: {len(rings)}", *(f"  {' <-> '.join(c)}" for c in rings)]
    lines += [f"unlayered units: {unlayered(root)}"]
    lines += [f"modules: {len(modules)}, largest: {sizes[-1][1]} ({sizes[-1][0]} lines)"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))
