"""mypy (run by ``.ci/run``) reads the whole package, strict where the seams are.

Read from pyproject.toml's ``[tool.mypy]``: every module of ``pd_transfer`` is in its
``files`` (or left out by name in ``exclude``), no override hides a package's errors
(``ignore_errors``, ``follow_imports = "silent"`` or ``"skip"``), the seams carry the
strict flags, and every ``# type: ignore`` in the package names its error code.
"""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pd_transfer"
MYPY = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]

#: the seams: each holds every strict flag of mypy's ``--strict`` that applies per module
SEAMS = ("pd_transfer.wire.*", "pd_transfer.protocol.*", "pd_transfer.transport.base", "pd_transfer.agent.*")
STRICT_FLAGS = (
    "disallow_any_generics",
    "disallow_subclassing_any",
    "disallow_untyped_calls",
    "disallow_untyped_defs",
    "disallow_incomplete_defs",
    "check_untyped_defs",
    "disallow_untyped_decorators",
    "warn_unused_ignores",
    "warn_return_any",
    "strict_equality",
    "extra_checks",
)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _checked(relative: str) -> bool:
    """Whether ``relative`` (a path from the repository root) is in mypy's ``files``."""
    for entry in MYPY["files"]:
        if any(ch in entry for ch in "*?["):  # a glob: its ``*`` stays within one folder
            parts, patterns = relative.split("/"), entry.split("/")
            if len(parts) == len(patterns) and all(map(fnmatch, parts, patterns)):
                return True
        elif relative == entry or relative.startswith(entry.rstrip("/") + "/"):
            return True
    return False


def _overrides_for(module: str) -> list[dict[str, object]]:
    found = []
    for override in MYPY.get("overrides", []):
        patterns = override["module"] if isinstance(override["module"], list) else [override["module"]]
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-2] + ".")):
                found.append(override)
    return found


def test_every_module_of_the_package_is_type_checked():
    excluded = [re.compile(pattern) for pattern in MYPY.get("exclude", [])]
    paths = sorted(path.relative_to(ROOT).as_posix() for path in PACKAGE.rglob("*.py"))
    checked = [path for path in paths if _checked(path)]
    # a checked module's packages are checked with it (mypy reads a module's ancestors)
    ancestors = {"/".join(p.split("/")[:n]) + "/__init__.py" for p in checked for n in range(1, p.count("/"))}
    unchecked = [
        path
        for path in paths
        if path not in checked
        and path not in ancestors
        and not any(pattern.search(path) for pattern in excluded)
    ]
    assert unchecked == [], f"modules mypy never reads (add their package to [tool.mypy] files): {unchecked}"


def test_no_override_hides_a_package_s_errors():
    hiding = [
        override["module"]
        for override in MYPY.get("overrides", [])
        if override.get("ignore_errors") or override.get("follow_imports") in ("silent", "skip")
    ]
    assert hiding == [], f"overrides that keep a package's errors from being reported: {hiding}"


def test_the_seams_are_strict():
    probes = {
        "pd_transfer.wire.*": PACKAGE / "wire" / "fields.py",
        "pd_transfer.protocol.*": PACKAGE / "protocol" / "messages.py",
        "pd_transfer.transport.base": PACKAGE / "transport" / "base.py",
        "pd_transfer.agent.*": PACKAGE / "agent" / "decode" / "side.py",
    }
    assert set(probes) == set(SEAMS)
    lax = {}
    for seam, path in probes.items():
        assert path.exists(), path
        flags: dict[str, object] = {}
        for override in _overrides_for(_module(path)):
            flags.update(override)
        missing = [flag for flag in STRICT_FLAGS if flags.get(flag) is not True]
        if flags.get("implicit_reexport") is not False:
            missing.append("implicit_reexport = false")
        if missing:
            lax[seam] = missing
    assert lax == {}, f"strict flags missing at the seams: {lax}"


def test_every_type_ignore_names_its_error_code():
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in re.finditer(r"#\s*type:\s*ignore(\[[^\]]*\])?", line):
                if match.group(1) is None:
                    bare.append(f"{path.relative_to(ROOT)}:{number}")
    assert bare == [], f"a `# type: ignore` without its error code: {bare}"
