"""The flags of ``pd-transfer serve`` that set a ``[sidecar]`` field, declared once.

Each entry names the :class:`~pd_transfer.config.sidecar.SidecarConfig` field it sets
(the flag is the field's name with dashes, unless the entry spells another),
its argparse options and its help. The help's default is read from
``SidecarConfig`` itself, so ``--help`` cannot drift from what the sidecar
runs with. :func:`add_serve_flags` declares them on a parser and
:func:`flag_overrides` reads them back as config overrides, keyed by field.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from pd_transfer.config.sidecar import SidecarConfig


@dataclass(frozen=True)
class ServeFlag:
    field: str  # the SidecarConfig field it sets
    help: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    flag: str = ""  # the flag, where it is not --<field-with-dashes>
    default_note: str = ""  # the default as the help states it, where the field's value says less

    @property
    def name(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


SERVE_FLAGS: tuple[ServeFlag, ...] = (
    ServeFlag("role", "which side this worker is", {"choices": ["prefill", "decode"]}),
    ServeFlag("agent_id", "name in logs and on the wire", default_note="role-pid"),
    ServeFlag(
        "worker_endpoint",
        "where the worker connects: unix://PATH, a plain Unix socket, or "
        "ipc://PATH, ZeroMQ (slower per call)",
        {"metavar": "unix://PATH"},
        default_note="unix:///tmp/pd-transfer-<agent id>.sock",
    ),
    ServeFlag("control_host", "address peers reach this sidecar on"),
    ServeFlag("control_port", "control port (0: any free port)", {"type": int}),
    ServeFlag(
        "bootstrap", "prefill: rank 0 binds here, other ranks announce here", {"metavar": "tcp://HOST:PORT"}
    ),
    ServeFlag(
        "transport",
        "data plane (auto: shm on the same host, else tcp; mooncake, nixl: "
        "engines, pip extras pd-transfer[mooncake] / pd-transfer[nixl])",
        {"choices": ["auto", "shm", "tcp", "mooncake", "nixl"]},
    ),
    ServeFlag(
        "strategy",
        "engine transports: one descriptor per run (direct), runs gathered "
        "into staging slots and scattered by decode (staged), or auto: chosen per peer and "
        "pool from the run sizes and a probe of the path",
        {"choices": ["auto", "direct", "staged"]},
    ),
    ServeFlag(
        "data_host",
        "address the data listeners bind: decode's tcp receiver and engine staging port, "
        "and both roles' nixl (UCX) listeners (mooncake publishes it, but its engine "
        "listens on every interface)",
    ),
    ServeFlag("http_host", "address of /metrics /healthz /readyz /status /runbooks/"),
    ServeFlag("http_port", "HTTP port (0: any free port)", {"type": int}),
    ServeFlag(
        "ready_file",
        "write the bound addresses as JSON here once serving",
        {"metavar": "FILE"},
        default_note="none",
    ),
    ServeFlag(
        "max_rooms_per_peer",
        "live rooms with one peer; more wait up to --admission-wait-s",
        {"type": int, "metavar": "N"},
    ),
    ServeFlag(
        "max_inflight_nbytes_total",
        "prefill: bytes being written to all decode peers at once",
        {"type": int, "metavar": "BYTES"},
    ),
    ServeFlag(
        "admission_wait_s",
        "how long a room or chunk over a limit waits before it fails with backpressure_timeout",
        {"type": float, "metavar": "SECONDS"},
    ),
    ServeFlag(
        "integrity",
        "checksum every block sent; decode verifies them and fails a room "
        "with integrity_mismatch (active when both sides enable it)",
        {"action": "store_true", "default": None},
    ),
    ServeFlag(
        "fault_corrupt_nth",
        "TEST ONLY: flip one byte of this sidecar's Nth data write "
        "(fault injection for integrity tests; never in production)",
        {"type": int, "metavar": "N"},
    ),
    ServeFlag(
        "allow_insecure",
        "serve without a shared secret (allow_insecure = true): anyone "
        "who reaches the ports may use this sidecar; for a trusted sandbox only",
        {"action": "store_true", "default": None},
        flag="--insecure",
    ),
    ServeFlag(
        "allow_unauthenticated_engine",
        "transport mooncake or nixl: accept that the engine's own listeners authenticate "
        "nobody (anyone who reaches them can read and write the registered memory; "
        "mooncake's listen on every interface); without it such a sidecar does not start",
        {"action": "store_true", "default": None},
    ),
)

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SidecarConfig)}

#: field -> the flag that sets it (problems in flag values name the flag)
FLAG_OF = {entry.field: entry.name for entry in SERVE_FLAGS}


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    for entry in SERVE_FLAGS:
        parser.add_argument(entry.name, dest=entry.field, help=_help(entry), **entry.options)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as config overrides, by field (None: the flag was not given)."""
    return {entry.field: getattr(args, entry.field) for entry in SERVE_FLAGS}


def _help(entry: ServeFlag) -> str:
    if entry.default_note:
        return f"{entry.help} (default: {entry.default_note})"
    default = _DEFAULTS.get(entry.field, dataclasses.MISSING)
    if default is dataclasses.MISSING or default in ("", None) or isinstance(default, bool):
        return entry.help  # a switch, or a field without a default
    if isinstance(default, int) and default >= 1 << 20 and default % (1 << 20) == 0:
        default = f"{default} = {_binary(default)}"
    return f"{entry.help} (default: {default})"


def _binary(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
