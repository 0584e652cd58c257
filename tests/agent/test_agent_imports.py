"""The agent's import graph: a side never holds its sidecar, and no module of the agent
reaches itself through its imports.

Read with ast (``test_agent_layering.imported_modules``): an import under
``if TYPE_CHECKING:`` or inside a function is an edge as much as one at the top, since
a reader (and a type checker) follows it all the same. A side is handed a
``SideContext`` (agent/side_context.py); only the sidecar itself and ``roles``, which
builds one, import ``Sidecar``.
"""

from pathlib import Path

from test_agent_layering import AGENT, PACKAGE, _module_name, imported_modules

MAY_IMPORT_SIDECAR = {"pd_transfer.agent.sidecar", "pd_transfer.agent.roles"}


def _graph(root: Path, package_root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``root`` it imports (a name ``from`` a package counts as
    its submodule when that is a module of ``root``)."""
    modules = {_module_name(path, package_root): path for path in sorted(root.rglob("*.py"))}
    return {
        name: {
            imported
            for _, imported in imported_modules(path, package_root)
            if imported in modules and imported != name
        }
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end),
    or [] if there is none."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str]:
        path.append(module)
        on_path.add(module)
        for imported in sorted(graph[module]):
            if imported in on_path:
                return [*path[path.index(imported) :], imported]
            if imported not in done:
                found = visit(imported)
                if found:
                    return found
        path.pop()
        on_path.discard(module)
        done.add(module)
        return []

    for module in sorted(graph):
        if module not in done:
            found = visit(module)
            if found:
                return found
    return []


def test_only_the_sidecar_and_roles_import_sidecar():
    importers = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if _module_name(path, PACKAGE.parent) not in MAY_IMPORT_SIDECAR
        for line, name in imported_modules(path)
        if name == "pd_transfer.agent.sidecar" or name.startswith("pd_transfer.agent.sidecar.")
    ]
    assert importers == [], "a side is given a SideContext (agent/side_context.py), not the sidecar"


def test_the_agent_has_no_import_cycle():
    graph = _graph(AGENT, PACKAGE.parent)
    assert "pd_transfer.agent.prefill.side" in graph and "pd_transfer.agent.sidecar" in graph
    assert _cycle(graph) == []


def test_a_type_checking_import_closes_a_cycle(tmp_path):
    """The check itself: an import under ``if TYPE_CHECKING:`` that leads back is a cycle."""
    package = tmp_path / "pkg"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.inner import b\n")
    (package / "inner" / "b.py").write_text("from . import c\n")
    (package / "inner" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    graph = _graph(package, tmp_path)
    assert _cycle(graph) == ["pkg.a", "pkg.inner.b", "pkg.inner.c", "pkg.a"]
    (package / "inner" / "c.py").write_text("from typing import TYPE_CHECKING\n")
    assert _cycle(_graph(package, tmp_path)) == []
