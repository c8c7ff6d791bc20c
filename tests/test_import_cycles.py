"""No import cycle anywhere in the repository: ``src/``, ``tests/``, ``benchmarks/`` and any other
Python file ``git`` sees (tracked or not ignored). import-linter holds ``layerwise`` to its layers;
this holds every file, scripts included, to the plainer rule that module A importing B (at load
time or inside a function) means B never imports A, directly or through others.

Resolution: ``layerwise.x`` is ``src/layerwise/x``; other dotted names are paths from the
repository root (``benchmarks.gpu_check.cli``); a bare name also resolves to a file beside the
importer or in ``benchmarks/`` (the scripts there put their folder on ``sys.path``). ``from a
import b`` is an edge to ``a.b`` when that is a module, else to ``a``; importing a package's
module is not counted as importing the packages above it.

Mutation seen failing: ``from .plans import run_plan`` inside a function of
``benchmarks/gpu_check/model.py`` (plans imports model: the cycle is named)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [ROOT / n for n in filter(None, out.split("\0")) if (ROOT / n).is_file()]


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC if path.is_relative_to(SRC) else ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(base, names) of every import statement, relative ones made absolute: ``import a.b`` is
    ``("a.b", [])``, ``from a import b, c`` is ``("a", ["b", "c"])``."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((base, [a.name for a in node.names]))
    return out


def import_graph(files: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the repository's modules it imports; ``files`` maps a module name to (source,
    whether it is a package's ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in files.items():
        here = module if is_package else module.rpartition(".")[0]
        prefixes = ["", f"{here}." if here else "", "benchmarks."]

        def resolve(name: str) -> str | None:
            for prefix in prefixes:
                parts, least = (prefix + name).split("."), prefix.count(".") + 1
                for i in range(len(parts), least - 1, -1):  # the most specific module that exists
                    if ".".join(parts[:i]) in files:
                        return ".".join(parts[:i])
            return None

        edges = set()
        for base, names in _imported_names(ast.parse(source), module, is_package):
            for target in [resolve(f"{base}.{n}") for n in names] or [resolve(base)]:
                if target is not None and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycle_in_the_repository():
    files = {}
    for path in _python_files():
        files[_module_name(path)] = (path.read_text(), path.name == "__init__.py")
    graph = import_graph(files)
    # the walk found the repository and resolves each kind of import
    assert "benchmarks.gpu_check.model" in graph["benchmarks.gpu_check.plans"]  # relative
    assert "layerwise.engine.batch" in graph["benchmarks.gpu_check.plans"]  # in a function
    assert "benchmarks.ckpt_finetune_setup" in graph["benchmarks.ckpt_finetune"]  # a script's sibling
    assert any(m.startswith("tests.") for m in graph) and any(m.startswith("layerwise.") for m in graph)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_detector_sees_a_cycle_through_a_function_level_import():
    files = {"pkg": ("", True),
             "pkg.a": ("from .b import f\n", False),
             "pkg.b": ("def f():\n    from pkg import c\n", False),
             "pkg.c": ("import pkg.a\n", False),
             "pkg.d": ("import pkg.a\n", False),
             "tool": ("import helper\n", False), "helper": ("", False)}
    graph = import_graph(files)
    assert graph["pkg.b"] == {"pkg.c"} and graph["tool"] == {"helper"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
