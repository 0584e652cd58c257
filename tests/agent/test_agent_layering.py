"""The agent's folders keep their layering (pd_transfer/agent/__init__.py).

Read with ast, so an import inside a function counts as much as one at the
top: ``agent/prefill/`` never imports ``agent/decode/`` nor the reverse, and
outside the agent only the entry points that start a sidecar import it.
"""

import ast
from pathlib import Path

import pd_transfer

PACKAGE = Path(pd_transfer.__file__).resolve().parent
AGENT = PACKAGE / "agent"
STARTS_A_SIDECAR = {"cli.py", "commands/serve.py", "commands/demo.py"}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PACKAGE.parent) -> list[tuple[int, str]]:
    """Every module ``path`` (a file under ``root``) imports, with its line, relative imports resolved."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _reaches(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(paths: list[Path], forbidden: str) -> list[str]:
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in paths
        for line, name in imported_modules(path)
        if _reaches(name, forbidden)
    ]


def test_prefill_never_imports_decode():
    paths = sorted((AGENT / "prefill").rglob("*.py"))
    assert paths, "agent/prefill/ has no modules"
    assert _violations(paths, "pd_transfer.agent.decode") == []


def test_decode_never_imports_prefill():
    paths = sorted((AGENT / "decode").rglob("*.py"))
    assert paths, "agent/decode/ has no modules"
    assert _violations(paths, "pd_transfer.agent.prefill") == []


def test_only_the_entry_points_import_the_agent():
    outside = [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if AGENT not in path.parents and path.relative_to(PACKAGE).as_posix() not in STARTS_A_SIDECAR
    ]
    assert outside, "no module outside the agent found"
    assert _violations(outside, "pd_transfer.agent") == []


def test_the_check_sees_relative_and_nested_imports(tmp_path):
    """The reader is not blind: it resolves ``from ..decode import side`` inside a function."""
    probe = tmp_path / "pd_transfer" / "agent" / "prefill" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    from ..decode import side\n    import pd_transfer.agent.decode.bells\n")
    names = [name for _, name in imported_modules(probe, tmp_path)]
    assert "pd_transfer.agent.decode.side" in names
    assert "pd_transfer.agent.decode.bells" in names
