"""Model presets: named TOML files of model geometry, loaded as a ModelSpec.

A preset is ``<name>.toml`` holding one ``[model]`` table in the format of
:func:`model_from_table` (see :mod:`pd_transfer.layout.model_table`). They are
looked up in the installed package first (``pd_transfer/_presets/``, which the
packaging copies from ``configs/models``), then in the repository checkout
(``<repo>/configs/models``).

Pure; reads files with ``tomllib`` but imports nothing above the layout layer.
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.model_spec import LINEAR_KINDS, LayerKind, ModelSpec
from pd_transfer.layout.model_table import model_from_table

__all__ = [
    "LINEAR_KINDS",
    "LayerKind",
    "ModelSpec",
    "load_preset",
    "model_from_table",
    "preset_dir",
    "preset_names",
]

_PACKAGE_PRESETS = Path(__file__).resolve().parents[1] / "_presets"
_REPO_PRESETS = Path(__file__).resolve().parents[2] / "configs" / "models"


def preset_dir() -> Path:
    """Where presets are read from: the installed copy if present, else the repo."""
    if _PACKAGE_PRESETS.is_dir():
        return _PACKAGE_PRESETS
    return _REPO_PRESETS


def preset_names() -> list[str]:
    """Names of the known presets, sorted."""
    directory = preset_dir()
    if not directory.is_dir():
        return []
    return sorted(path.stem for path in directory.glob("*.toml"))


@functools.cache
def load_preset(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of preset ``name``, or ConfigError ``unknown_preset``."""
    known = preset_names()
    if name not in known:
        raise ConfigError(
            f"unknown model preset {name!r}; known presets: {', '.join(known)}",
            code=Reason.UNKNOWN_PRESET,
            hint="give the geometry explicitly in a [model] table instead",
        )
    path = preset_dir() / f"{name}.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read model preset {path}: {exc}") from None
    if "model" not in data:
        raise ConfigError(f"model preset {path} has no [model] table")
    spec = model_from_table(data["model"], str(path))
    if spec.name != name:
        raise ConfigError(
            f"model preset {path}: model.name is {spec.name!r} but the file "
            f"is named {name!r}; they must match"
        )
    return spec
