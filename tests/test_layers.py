"""The package's layering, read from its source: every import (module-level and inside
functions) goes to the same or a lower layer of psparse/layers.py, and no modules import each
other in a circle. Nothing is imported or run: the imports are read with ast."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from psparse.layers import LAYERS, layer_of

ROOT = Path(__file__).resolve().parent.parent


def modules(package_dir: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module under ``package_dir``."""
    out = {}
    for f in sorted(package_dir.rglob("*.py")):
        parts = f.relative_to(package_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) for every import of a package module in ``path``: ``from X
    import y`` counts as importing X.y where that is a module, else X."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    root = name.split(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == root or target.startswith(root + "."):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    found.append((target, node.lineno))
    return found


def layering_problems(package_dir: Path, layer_of=layer_of, layers=LAYERS) -> list[str]:
    """Every upward import and every circle of imports under ``package_dir``, each naming
    the files (and lines) involved."""
    known = modules(package_dir)
    rel = {name: path.relative_to(package_dir.parent) for name, path in known.items()}
    graph: dict[str, set[str]] = {}
    problems = []
    for name, path in known.items():
        graph[name] = set()
        for target, line in imports(name, path, known):
            graph[name].add(target)
            low, high = layer_of(name), layer_of(target)
            if high > low:
                problems.append(f"{rel[name]}:{line} (layer {layers[low][0]}) imports "
                                f"{rel[target]} (layer {layers[high][0]}, above it)")
    for circle in circles(graph):
        problems.append("import circle: " + " -> ".join(str(rel[m]) for m in circle + circle[:1]))
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of two or more modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [path_through(graph, sorted(g)) for g in groups]


def path_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A circle inside a strongly connected group, from its first module back to it."""
    start, members = group[0], set(group)
    parents, todo = {start: None}, [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return path[::-1]
            if w not in parents:
                parents[w] = v
                todo.append(w)
    return group


def test_psparse_imports_only_downward_and_in_no_circle():
    problems = layering_problems(ROOT / "psparse")
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    for name in modules(ROOT / "psparse"):
        layer_of(name)  # raises for a module the table does not place
    with pytest.raises(ValueError, match="psparse.newtool is in no layer"):
        layer_of("psparse.newtool")


def test_the_check_finds_a_planted_upward_import_and_a_circle(tmp_path):
    """A package of three floors where the bottom imports the top (inside a function, as a
    lazy import) and two modules of the middle import each other."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "mid").mkdir()
    for f in ("__init__.py", "low/__init__.py", "mid/__init__.py", "top.py"):
        (pkg / f).write_text("")
    (pkg / "low" / "core.py").write_text("def f():\n    from ..top import g\n    return g\n")
    (pkg / "mid" / "a.py").write_text("from . import b\n")
    (pkg / "mid" / "b.py").write_text("from pkg.mid.a import x\n")
    floors = (("low", ("pkg.low",), ""), ("mid", ("pkg.mid",), ""), ("top", ("pkg", "pkg.top"), ""))

    def floor_of(module):
        return 1 if module.startswith("pkg.mid") else 0 if module.startswith("pkg.low") else 2

    problems = layering_problems(pkg, floor_of, floors)
    assert problems == [
        "pkg/low/core.py:2 (layer low) imports pkg/top.py (layer top, above it)",
        "import circle: pkg/mid/a.py -> pkg/mid/b.py -> pkg/mid/a.py"], problems


def path_of(member: str) -> str:
    """How docs/architecture.md names a table entry: a folder with its slash, a module as its
    file, and the package itself (the api layer holds only its __init__) as that file."""
    if member == "psparse":
        return "psparse/__init__.py"
    path = member.replace(".", "/")
    return path + "/" if (ROOT / path).is_dir() else path + ".py"


def test_docs_architecture_lists_the_layers_as_the_code_does():
    """docs/architecture.md's folder table: one row per layer, bottom up, naming the same
    modules and folders."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == len(LAYERS) + 1  # the header, then one row per layer
    for row, (layer, members, _) in zip(rows[1:], LAYERS):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == layer, row
        named = set(re.findall(r"`([^`]+)`", cells[1]))
        paths = {path_of(m) for m in members}
        assert named == paths, (layer, named, paths)


def test_every_folder_of_modules_is_a_package():
    """A folder without __init__.py imports here (a namespace package) but setuptools'
    find_packages leaves it out of a wheel: each must have one."""
    for folder in {f.parent for f in (ROOT / "psparse").rglob("*.py")}:
        if "__pycache__" not in folder.parts:
            assert (folder / "__init__.py").is_file(), folder


def test_no_module_outside_the_kernel_folders_is_over_450_lines():
    """One job a module: the long ones are split by job; only the operations and backends
    (psparse/ops/, psparse/backends/: kernels, whose loops are long by nature) may run longer."""
    for f in (ROOT / "psparse").rglob("*.py"):
        if not {"ops", "backends"} & set(f.relative_to(ROOT / "psparse").parts[:1]):
            assert len(f.read_text().splitlines()) <= 450, f


# What a worker's round does on the wire and to a GradScaler's step, and where it may be written:
# psparse/worker/round.py (the round, once for every device, whole or in parts) and the round
# shapes in exchange.py (a two-phase round's proposal); the client modules define the calls.
ROUND_CALLS = re.compile(r"\bclient\.(push|send_part|propose)\(|\bscaling\.(poison|rescale)\(")
ROUND_FILES = {"psparse/worker/round.py", "psparse/worker/exchange.py"}


def round_calls(root: Path) -> dict[str, list[str]]:
    """{file under root: the round's calls it makes} for every module that makes one."""
    found = {}
    for f in sorted((root / "psparse").rglob("*.py")):
        calls = [m.group(0) for m in ROUND_CALLS.finditer(f.read_text())]
        if calls:
            found[f.relative_to(root).as_posix()] = calls
    return found


def test_a_workers_round_is_written_once():
    """Host and GPU, whole model and parts share one round (psparse/worker/round.py): no other
    module pushes, proposes, or finishes a GradScaler's step."""
    found = round_calls(ROOT)
    assert set(found) == ROUND_FILES, found
    assert sorted(found["psparse/worker/exchange.py"]) == ["client.propose("]


def test_the_round_check_finds_a_second_round(tmp_path):
    planted = tmp_path / "psparse" / "worker" / "my_round.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def exchange(ctx, it):\n    ctx.client.push(it, [], [])\n"
                       "    ctx.scaling.rescale(ctx.net)\n")
    assert round_calls(tmp_path) == {"psparse/worker/my_round.py": ["client.push(",
                                                                     "scaling.rescale("]}
