"""The code map in ``docs/architecture.md`` matches the tree and the import arrows.

The map has one row per folder of ``pd_transfer/`` and one row per group of
root modules, each with a *may import* cell of backticked names, relative to
``pd_transfer/`` (``transport/copy``) or third-party (``numpy``). These tests
check that:

- every folder holding Python files is in the map, and every folder the map
  names exists; every root module is in exactly one group;
- no name a folder's cell allows is one that its layer may not import, by
  the table ``FORBIDDEN`` of ``tests/test_import_arrows.py`` (loaded from
  that file, not copied; folders of no layer named there, such as ``sim/``
  and ``testing/``, get only the next check);
- every package module and third-party package a folder's modules import,
  function-local imports too, is covered by a name its cell allows (imports
  within the folder and its subfolders, and of the standard library, need
  none).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pd_transfer"
ARCHITECTURE = REPO / "docs" / "architecture.md"
NAME = re.compile(r"`([^`]+)`(\s*\(([^)]*)\))?")
NEVER = re.compile(r"\(never [^)]*\)")


def _load_arrows():
    path = REPO / "tests" / "test_import_arrows.py"
    spec = importlib.util.spec_from_file_location("_import_arrows_for_code_map", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARROWS = _load_arrows()


def _section(text: str) -> str:
    start = text.index("## Code map")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _rows(text: str) -> dict[str, tuple[list[str], list[str], list[str]]]:
    """A row's first cell -> (its names, the names it may import, the names it never imports)."""
    rows = {}
    for line in _section(text).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or set(cells[0]) <= {"-"}:
            continue
        members = re.findall(r"`([^`]+)`", cells[0])
        if members:
            rows[cells[0]] = (members, _allowed(cells[2]), _never(cells[2]))
    return rows


def _allowed(cell: str) -> list[str]:
    """A cell's names: ``transport`` (``base``) is ``transport/base``; ``(never ...)`` names nothing allowed."""
    names = []
    for match in NAME.finditer(NEVER.sub("", cell)):
        parts = re.findall(r"`([^`]+)`", match.group(3) or "")
        names += [f"{match.group(1).rstrip('/')}/{part}" for part in parts] or [match.group(1)]
    return names


def _never(cell: str) -> list[str]:
    return [name for clause in NEVER.findall(cell) for name in re.findall(r"`([^`]+)`", clause)]


def _folder_rows(text: str | None = None) -> dict[str, list[str]]:
    rows = _rows(text or ARCHITECTURE.read_text()).values()
    return {members[0].rstrip("/"): allowed for members, allowed, _ in rows if members[0].endswith("/")}


def _folder_nevers() -> dict[str, list[str]]:
    rows = _rows(ARCHITECTURE.read_text()).values()
    return {members[0].rstrip("/"): never for members, _, never in rows if never}


def _root_rows() -> list[tuple[list[str], list[str]]]:
    rows = _rows(ARCHITECTURE.read_text()).values()
    return [(members, allowed) for members, allowed, _ in rows if not members[0].endswith("/")]


def _tree_folders() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*"):
        if path.is_dir() and "__pycache__" not in path.parts and any(path.glob("*.py")):
            found.add(path.relative_to(PACKAGE).as_posix())
    found.discard(".")
    return found


def _dotted(name: str) -> str:
    """A cell's name as an import name: ``transport/copy`` -> ``pd_transfer.transport.copy``."""
    stem = name.rstrip("/").removesuffix(".py").replace("/", ".")
    first = stem.split(".")[0]
    if (PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").exists():
        return f"pd_transfer.{stem}"
    return stem


def _owner(name: str) -> str | None:
    """What an imported name needs a cell to cover: a package module, a third-party package, or nothing."""
    top = name.split(".")[0]
    if top == "pd_transfer":
        parts = name.split(".")
        while len(parts) > 1:
            path = REPO.joinpath(*parts)
            if path.is_dir() or path.with_suffix(".py").exists():
                return ".".join(parts)
            parts.pop()
        return None  # the package root itself (``__version__``)
    if top in sys.stdlib_module_names or top == "__future__":
        return None
    return top


def _needed(modules: list[Path], home: list[str]) -> set[str]:
    """What ``modules`` import; ``from package import module`` needs the module, not the package."""
    needed = set()
    for path in modules:
        imports = ARROWS._imports(path)
        for line, name in imports:
            owner = _owner(name)
            submodules = {
                _owner(other) for at, other in imports if at == line and other.startswith(f"{name}.")
            }
            if owner == name and submodules - {owner}:
                continue
            if owner and not any(ARROWS._under(owner, own) for own in home):
                needed.add(owner)
    return needed


def _uncovered(needed: set[str], allowed: list[str]) -> list[str]:
    names = [_dotted(name) for name in allowed]
    return sorted(name for name in needed if not any(ARROWS._under(name, prefix) for prefix in names))


def test_every_folder_of_the_package_is_in_the_code_map():
    assert sorted(_tree_folders() - set(_folder_rows())) == []


def test_every_folder_the_code_map_names_exists():
    assert sorted(set(_folder_rows()) - _tree_folders()) == []


def test_every_root_module_is_in_exactly_one_group():
    named = [member for members, _ in _root_rows() for member in members]
    on_disk = sorted(path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    assert sorted(named) == on_disk


def _against_arrows(folder: str, allowed: list[str]) -> list[str]:
    module = "pd_transfer." + folder.replace("/", ".")
    layer = ARROWS._layer_of(module)
    return [
        f"{name} (forbidden to {layer})"
        for name in map(_dotted, allowed)
        for prefix in ARROWS.FORBIDDEN.get(layer, [])
        if ARROWS._under(name, prefix) and not ARROWS._under(module, prefix)
    ]


@pytest.mark.parametrize("folder", sorted(_folder_rows()))
def test_a_folders_may_import_follows_the_arrows(folder):
    assert _against_arrows(folder, _folder_rows()[folder]) == []


@pytest.mark.parametrize("folder", sorted(_folder_rows()))
def test_a_folder_imports_only_what_its_entry_allows(folder):
    home = "pd_transfer." + folder.replace("/", ".")
    needed = _needed(sorted((PACKAGE / folder).glob("*.py")), [home])
    assert _uncovered(needed, _folder_rows()[folder]) == []


@pytest.mark.parametrize("folder", sorted(_folder_nevers()))
def test_a_folder_imports_nothing_its_entry_says_it_never_imports(folder):
    home = "pd_transfer." + folder.replace("/", ".")
    needed = _needed(sorted((PACKAGE / folder).glob("*.py")), [home])
    never = [_dotted(name) for name in _folder_nevers()[folder]]
    assert sorted(name for name in needed if any(ARROWS._under(name, prefix) for prefix in never)) == []


def test_a_root_group_imports_only_what_its_entry_allows():
    uncovered = {}
    for members, allowed in _root_rows():
        home = [_dotted(member) for member in members]
        needed = _needed([PACKAGE / member for member in members], home)
        if missing := _uncovered(needed, allowed):
            uncovered[", ".join(members)] = missing
    assert uncovered == {}


def test_the_checks_see_a_missing_folder_an_unknown_one_and_a_forbidden_name():
    lines = _section(ARCHITECTURE.read_text()).splitlines()
    edited = [line for line in lines if not line.startswith("| `sim/` |")] + ["| `nowhere/` | - | - |"]
    rows = _folder_rows("\n".join(edited) + "\n## End\n")
    assert _tree_folders() - set(rows) == {"sim"}
    assert set(rows) - _tree_folders() == {"nowhere"}
    assert _against_arrows("integrations/vllm", ["client", "agent"]) == [
        "pd_transfer.agent (forbidden to pd_transfer.integrations)"
    ]
    assert _against_arrows("agent/decode", ["client"]) == [
        "pd_transfer.client (forbidden to pd_transfer.agent)"
    ]
    assert _uncovered({"pd_transfer.agent.sidecar"}, ["client", "layout"]) == ["pd_transfer.agent.sidecar"]
    assert _uncovered({"pd_transfer.transport.copy.runs", "numpy"}, ["transport", "numpy"]) == []
    cell = "the shared `agent` modules (never `agent/prefill/`), `transport` (`base`, `regions`), `numpy`"
    assert _allowed(cell) == ["agent", "transport/base", "transport/regions", "numpy"]
    assert _never(cell) == ["agent/prefill/"]
    assert _uncovered({"pd_transfer.transport.tcp.frames"}, _allowed(cell)) == [
        "pd_transfer.transport.tcp.frames"
    ]


def test_a_module_imported_from_its_package_needs_that_module_only(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from pd_transfer.memory import orphans\nfrom pd_transfer.protocol import PROTOCOL_VERSION\n"
    )
    assert _needed([source], ["pd_transfer.cli"]) == {"pd_transfer.memory.orphans", "pd_transfer.protocol"}
