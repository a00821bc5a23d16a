"""The import graph of tpkit: no cycles, and library modules import tpkit at the top.

Every import counts, at module level or inside a function, and so does a literal module name given to
`importlib.import_module` (the families' dict, the built-in rewards): a cycle hidden inside a function
still ties the two modules together for a reader. An import `from tpkit.a import b` points at the
module `tpkit.a.b` when that is a module, else at `tpkit.a`. See docs/design.md section 4 for the
direction imports take.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tpkit

ROOT = Path(tpkit.__file__).resolve().parent
# Only the CLI imports its libraries inside functions: `tpkit --help` must not import torch. And the
# doctor, which must run (and say so) where torch is missing or broken: tpkit.memory needs torch.
LAZY_ALLOWED = {"tpkit.cli", "tpkit.__main__", "tpkit.doctor"}
MODULE_NAME = re.compile(r"^tpkit(\.\w+)+$")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _target(name: str, modules: dict) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, name: str, modules: dict) -> list[tuple[str, int, bool]]:
    """(imported tpkit module, line, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
            names = [node.value] if node.value in modules else []
        else:
            continue
        # a module named by a string is a dispatch by name (imported when used), not an import to hoist
        at_top = id(node) in top or isinstance(node, ast.Constant)
        for n in names:
            if n.startswith("tpkit") and (t := _target(n, modules)) and t != name:
                out.append((t, node.lineno, at_top))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    graph, lazy = {m: set() for m in modules}, []
    for name, path in modules.items():
        for target, line, at_top in _imports(path, name, modules):
            graph[name].add(target)
            if not at_top and name not in LAZY_ALLOWED:
                lazy.append(f"{path.relative_to(ROOT.parent)}:{line} imports {target} inside a function")
    return graph, lazy


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph, _ = _graph()
    assert _cycles(graph) == [], "modules that import each other (directly or around a circle)"


def test_library_modules_import_tpkit_at_the_top():
    _, lazy = _graph()
    assert lazy == []


def test_the_checker_sees_cycles_and_lazy_imports(tmp_path, monkeypatch):
    """The checks above can fail: a function-level import that closes a circle is found."""
    pkg = tmp_path / "tpkit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tpkit.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    import importlib\n    return importlib.import_module('tpkit.c')\n")
    (pkg / "c.py").write_text("def g():\n    from tpkit import a\n")
    monkeypatch.setattr(tpkit, "__file__", str(pkg / "__init__.py"))
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph, lazy = _graph()
    assert _cycles(graph) == [["tpkit.a", "tpkit.c", "tpkit.sub.b"]]
    assert lazy == ["tpkit/c.py:2 imports tpkit.a inside a function"]
