"""The house's size and naming limits, checked over the whole package.

No module over 400 lines, no function over 60 lines (from ``def`` to its
last line, docstring included), and no top-level class name defined in two
modules (one name, one concept). Each failure names the module, the function
or the class, so the fix is where the message points.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pd_transfer"

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> list[tuple[str, ast.Module, int]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        source = path.read_text(encoding="utf-8")
        found.append((name, ast.parse(source, filename=str(path)), len(source.splitlines())))
    return found


def test_no_module_over_the_line_limit():
    long = [f"{name}: {lines} lines" for name, _, lines in _modules() if lines > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split by concept): {long}"


def test_no_function_over_the_line_limit():
    long = []
    for name, tree, _ in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_class_name_defined_in_two_modules():
    defined: dict[str, list[str]] = collections.defaultdict(list)
    for name, tree, _ in _modules():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                defined[node.name].append(name)
    twice = {cls: where for cls, where in defined.items() if len(where) > 1}
    assert not twice, f"class names defined in more than one module: {twice}"


def test_the_checks_see_the_package():
    names = {name for name, _, _ in _modules()}
    assert "layout/reconcile.py" in names and "observability/metrics.py" in names
