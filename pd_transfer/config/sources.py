"""Where sidecar settings come from, each value kept with the place it came from.

A TOML file's ``[sidecar]`` table, ``PD_TRANSFER_*`` variables and flags all
become :class:`Setting` values whose ``origin`` is what a problem names:
``sidecar.toml: sidecar.http_port``, ``PD_TRANSFER_HTTP_PORT``, ``--http-port``.
Pure reading: the values are checked in :mod:`pd_transfer.config.sidecar`.

Nothing is ignored without a word. In a file, a key outside ``[sidecar]`` and
a table of any other name are problems. A ``PD_TRANSFER_*`` variable is a
setting when the rest of its name is a ``[sidecar]`` key in upper case; the
few other variables pd-transfer reads (:data:`OTHER_VARIABLES`), those of
pd-transfer's components that share a shell with the sidecar
(:data:`COMPONENT_VARIABLES`: an engine backend started beside it) and the ones
Kubernetes service links inject (:data:`SERVICE_LINK`) are left alone; any
other is a problem, with the nearest known name as a suggestion.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_transfer.errors import ConfigError

ENV_PREFIX = "PD_TRANSFER_"
TABLE = "sidecar"

# read by other parts of pd-transfer, not settings of the [sidecar] table
OTHER_VARIABLES = {
    "PD_TRANSFER_SECRET": "the shared secret itself (security/secret.py)",
    "PD_TRANSFER_NATIVE_COPY": "0 turns the native copy loop off (transport/copy/native_loop.py)",
    "PD_TRANSFER_NO_NATIVE_IO": "set: socket reads without the native helper (transport/tcp/native_io.py)",
    "PD_TRANSFER_SIGBUS_GUARD": "0 turns the mapped-segment fault guard off (memory/segment_guard.py)",
}

# read by pd-transfer's components in the engine's process, which often shares the
# sidecar's environment (one shell, one pod spec): the SGLang backend's settings
# (integrations/sglang/settings.py; a test keeps the two lists equal). The sidecar
# never imports integrations/, so the names are listed here.
COMPONENT_VARIABLES = {
    f"PD_TRANSFER_SGLANG_{name}": "a setting of the SGLang backend (docs/sglang.md)"
    for name in (
        "WORKER_ENDPOINT",
        "BOOTSTRAP_PORT",
        "CALL_TIMEOUT_S",
        "REGISTER_TIMEOUT_S",
        "BOOTSTRAP_TIMEOUT_S",
        "PREFILL_DP_SIZE",
    )
}

# What kubelet injects for a Service named pd-transfer[-<rest>] when the pod has
# service links (the default): for a Service pd-transfer-prefill with port 8998/TCP,
# PD_TRANSFER_PREFILL_SERVICE_HOST, PD_TRANSFER_PREFILL_SERVICE_PORT[_<PORTNAME>],
# PD_TRANSFER_PREFILL_PORT, PD_TRANSFER_PREFILL_PORT_8998_TCP[_PROTO|_PORT|_ADDR].
SERVICE_LINK = re.compile(
    r"(?:[A-Z0-9_]+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    r"|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)"
)
_LINK_VALUE = re.compile(r"(?:tcp|udp|sctp)://\S+:\d+")

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True)
class Setting:
    value: Any
    origin: str  # names the value in a problem: file and key, variable, or flag


def file_settings(path: str, keys: Collection[str]) -> tuple[dict[str, Setting], list[str]]:
    """The ``[sidecar]`` table of ``path``, and a problem for every key it does not apply.

    ConfigError when the file cannot be read or is not TOML (nothing else to report then).
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    problems = []
    for key, value in data.items():
        if key == TABLE:
            continue
        if isinstance(value, dict):
            problems.append(
                f"{path}: [{key}]: unknown table, so nothing in it would be applied"
                f"{_did_you_mean(key, [TABLE], '[{}]')}: the sidecar reads only [{TABLE}]"
            )
        elif key in keys:
            problems.append(
                f"{path}: {key}: above the [{TABLE}] line, so in no table: move it below that line"
            )
        else:
            problems.append(
                f"{path}: {key}: unknown key outside any table"
                f"{_did_you_mean(key, keys)}: settings go below the [{TABLE}] line"
            )
    table = data.get(TABLE, {})
    if not isinstance(table, dict):
        problems.append(f"{path}: {TABLE}: must be a table ([{TABLE}]), got {table!r}")
        table = {}
    return {name: Setting(value, f"{path}: {TABLE}.{name}") for name, value in table.items()}, problems


def environ_settings(
    environ: Mapping[str, str], kinds: Mapping[str, str]
) -> tuple[dict[str, Setting], list[str]]:
    """Typed values of the ``PD_TRANSFER_*`` variables naming a setting (``kinds``: name ->
    type name), and a problem for every other ``PD_TRANSFER_*`` variable (see the module doc).

    A value that does not parse stays text: the type check names the variable and the value.
    """
    settings, problems = {}, []
    for variable, text in sorted(environ.items()):
        if not variable.startswith(ENV_PREFIX):
            continue
        name = variable[len(ENV_PREFIX) :].lower()
        kind = kinds.get(name)
        if kind is None:
            if not _known_elsewhere(variable):
                known = [
                    *kinds,
                    *(v[len(ENV_PREFIX) :].lower() for v in (*OTHER_VARIABLES, *COMPONENT_VARIABLES)),
                ]
                problems.append(
                    f"{variable}: not a pd-transfer setting"
                    f"{_did_you_mean(name, known, ENV_PREFIX + '{}', upper=True)}: a "
                    f"setting's variable is {ENV_PREFIX} and a [{TABLE}] key in upper "
                    f"case (docs/operations.md#configuration)"
                )
            continue
        if name.endswith("_port") and _LINK_VALUE.fullmatch(text.strip()):
            service = "pd-transfer-" + name.removesuffix("_port").replace("_", "-")
            problems.append(
                f"{variable}: {text!r} is a Kubernetes service link of a Service named "
                f"{service}, not a port: rename that Service, or set "
                f"enableServiceLinks: false in the pod spec"
            )
            continue
        settings[name] = Setting(_typed(kind, text), variable)
    return settings, problems


def _known_elsewhere(variable: str) -> bool:
    """``variable`` is read by another part of pd-transfer, or is a Kubernetes service link."""
    return (
        variable in OTHER_VARIABLES
        or variable in COMPONENT_VARIABLES
        or SERVICE_LINK.fullmatch(variable[len(ENV_PREFIX) :]) is not None
    )


def _typed(kind: str, text: str) -> Any:
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        return text
    if kind == "bool":
        return _BOOLS.get(text.strip().lower(), text)
    if kind.startswith("tuple"):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def _did_you_mean(name: str, choices: Collection[str], form: str = "{}", upper: bool = False) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.7)
    if not close:
        return ""
    return f" (did you mean {form.format(close[0].upper() if upper else close[0])}?)"
