"""No import loop inside the package, read from the source.

A loop is a set of modules that import one another round a cycle. Every
``import`` statement counts: function-local ones (they run on some path) and
the ones under ``if TYPE_CHECKING:`` (a loop of types is still two modules that
cannot be read, or changed, one without the other). ``from pkg import name``
is an import of ``pkg.name`` where that is a module, else of ``pkg``.

The package has none, and this test keeps it so.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pd_transfer"


def module_names(root: Path) -> dict[str, Path]:
    """``dotted name -> file`` of every module under ``root`` (a package's is its ``__init__``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: Iterable[str]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (at ``path``) imports, anywhere in it."""
    known = set(modules)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    found.add(target)
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def import_loops(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every set of two or more modules that reach one another (Tarjan's strongly
    connected components, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
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
                if len(component) > 1:
                    loops.append(sorted(component))
    return loops


def package_graph(root: Path) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_the_package_has_no_import_loop():
    assert import_loops(package_graph(ROOT)) == [], (
        "import loops (each a set of modules that import one another)"
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_reader_finds_loops_through_local_and_type_checking_imports(tmp_path):
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from pkg.sub import c\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import A\n",
            "pkg/d.py": "import pkg.a\n",  # into the loop, not part of it
        },
    )
    assert import_loops(package_graph(root)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_the_reader_finds_no_loop_in_a_chain(tmp_path):
    root = _write(
        tmp_path,
        {"pkg/__init__.py": "from pkg.a import A\n", "pkg/a.py": "from pkg.b import B\n", "pkg/b.py": ""},
    )
    assert package_graph(root) == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert import_loops(package_graph(root)) == []
