"""The package's layers (docs/architecture.md): no import cycles, function-local imports
included; imports only point down (core <- megatron seam <- cli <- training <- bridge); the seam folder
stays small; no reference to the historical design file or to issue numbers."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "loco_megatron"
#: layer of each top-level part of the package (higher may import lower, never the reverse)
LAYERS = {"megatron": 1, "cli": 2, "training": 3, "bridge": 4}
#: folders beside the layers: tools built on them (they may import the layers below them)
BESIDE = {"data": 0, "planner": 1, "emulation": 1}


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _import_graph():
    """``{module: {imported module}}`` of every import statement inside loco_megatron, at any
    depth (function-local imports included)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (package[:len(package) - node.level + 1] if node.level else [])
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _cycles(graph):
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return 0
    return LAYERS.get(parts[1], BESIDE.get(parts[1], 0))


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_imports_point_down_the_layers():
    wrong = [f"{a} -> {b}" for a, edges in _import_graph().items() for b in edges
             if a.split(".")[1:2] != b.split(".")[1:2] and _layer(b) > _layer(a)
             and a not in ("loco_megatron", "loco_megatron.__main__")]  # entry points
    assert wrong == []


def test_the_seam_folder_is_the_megatron_core_seam_only():
    seam = [p for p in (PACKAGE / "megatron").rglob("*.py") if p.name != "__init__.py"]
    # wrappers of megatron-core calls and the version adapter only (11: the parameter
    # all-gather's model-load wrapper beside its step-time wrappers)
    assert len(seam) <= 11, sorted(str(p) for p in seam)
    graph = _import_graph()
    for module in graph:
        if module.startswith("loco_megatron.megatron"):
            assert not any(_layer(t) > 1 for t in graph[module]), module


def _tracked_text_files():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".sh", ".sbatch", ".yaml", ".ini", ".cfg", ".txt"} \
                or name == ".ci/run":
            yield name, path.read_text(errors="replace")


@pytest.mark.parametrize("pattern", [r"DESIGN\.md", r"\b[Ii]ssues? #?\d+\b"])
def test_no_design_file_or_issue_references(pattern):
    hits = [name for name, text in _tracked_text_files() if re.search(pattern, text)
            and name != "tests/unit/test_layers.py"]
    assert hits == []
