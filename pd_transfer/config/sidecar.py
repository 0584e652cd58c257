"""Sidecar configuration: one frozen record, read from TOML and CLI flags.

``pd-transfer serve --role prefill|decode --config FILE`` reads a ``[sidecar]``
table; flags override the file; defaults fill the rest. Every bad field is
reported at once, each naming its path and what is accepted, as one
:class:`ConfigError` (the CLI turns it into exit code 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_transfer.config import addresses
from pd_transfer.config.extras import ENGINES, engine_missing
from pd_transfer.config.sources import ENV_PREFIX, Setting, environ_settings, file_settings
from pd_transfer.errors import ConfigError
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol.stream_frames import unix_path

TRANSPORTS = ("auto", "shm", "tcp", *ENGINES)
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
MAX_NIXL_UCX_THREADS = 64
STRATEGIES = ("auto", "direct", "staged")  # transport.strategy.StrategyMode's values


def default_host_id() -> str:
    """Identifies this machine: sidecars with equal host ids can use shared memory."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id[:8]}"


def default_copy_threads() -> int:
    """2, or 1 where this process may use one CPU: a sidecar shares its host with a worker."""
    return min(2, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class SidecarConfig:
    role: Role
    agent_id: str = ""
    host_id: str = field(default_factory=default_host_id)  # equal on two sidecars: shm possible
    control_host: str = "127.0.0.1"
    control_port: int = 0  # 0: any free port (see ready_file)
    data_host: str = "127.0.0.1"  # where data listeners bind: decode's tcp receiver and staging port, both roles' nixl (UCX) listeners
    data_port: int = 0  # decode: tcp data port (0: any free port)
    worker_endpoint: str = (
        ""  # where the worker connects: unix://PATH (plain Unix socket, fastest) or ipc://PATH (ZeroMQ)
    )
    bootstrap: str = ""  # prefill: rank 0 binds its rank table here, others announce
    transport: str = "auto"  # auto: shm on the same host, tcp across hosts; mooncake, nixl: engine extras
    mooncake_protocol: str = "tcp"  # transport mooncake: tcp, or rdma where RDMA NICs exist
    nixl_ucx_threads: int = 1  # prefill, transport nixl: UCX threads posting each write (1: the writing thread alone; more: NIXL's num_threads, a write's descriptors split among them)
    strategy: str = "auto"  # engine transports: direct runs, staged, or auto (chosen per peer and pool)
    staging_slots: int = (
        16  # decode, engine transports: staging slots registered with the engine (4 a prefill peer)
    )
    staging_slot_nbytes: int = 4 * 1024 * 1024  # decode, engine transports: bytes of one staging slot
    ready_file: str = ""  # JSON with the bound addresses, written when serving
    http_host: str = "127.0.0.1"  # /metrics /healthz /readyz /status /runbooks/
    http_port: int = 9400  # 0: any free port (see ready_file)
    instance_id: str = ""  # decode: the decode instance this rank belongs to, as routers name it (the same on each of its ranks)
    prefill_bootstraps: tuple[str, ...] = ()  # decode: prefill instances to resolve eagerly (readyz)
    bootstrap_timeout_s: float = 30.0  # expect(): rank table + verdicts
    waiting_timeout_s: float = 120.0  # decode waits for prefill's data; prefill for send()
    transfer_timeout_s: float = 60.0  # one room's bytes once sending started
    heartbeat_interval_s: float = 0.5  # between heartbeats on every peer session
    heartbeat_misses: int = 4  # silent intervals before a peer is lost
    slow_peer_limit_s: float = (
        30.0  # a peer on this host whose process runs (not stopped) is lost only once silent this long
    )
    peer_connection_timeout_s: float = 10.0  # a control connection whose data or keepalive probes the peer's host does not acknowledge this long closes, and the peer is lost: its host vanished (its kernel answers for a starved or stopped process)
    abort_drain_timeout_s: float = 10.0  # decode abort waits this long for drain acks
    room_ttl_s: float = 120.0  # terminal rooms kept for late polls
    max_rooms: int = 4096  # live rooms at most; more are refused at once
    max_rooms_per_peer: int = 1024  # live rooms with one peer; more wait (admission_wait_s)
    max_inflight_nbytes: int = 256 * 1024 * 1024  # prefill: bytes being written to one peer (tcp window)
    tcp_streams: int = (
        2  # prefill, tcp: connections to each peer; a long write is striped over them, the window shared out
    )
    max_inflight_nbytes_total: int = 1024 * 1024 * 1024  # prefill: bytes being written to all peers
    admission_wait_s: float = 5.0  # a room or chunk over a limit waits this long, then fails
    max_worker_requests: int = 8192  # worker API requests in progress; more are refused at once
    max_chunks_per_room: int = 4096  # prefill: send() calls per room; more fail the room
    data_handshake_timeout_s: float = 10.0  # decode, tcp and engine staging: a data connection authenticates within this time of its accept, or is dropped
    max_pending_data_connections: int = 64  # decode, tcp and engine staging: data connections not yet authenticated; one more drops the oldest
    control_handshake_timeout_s: float = 10.0  # control and bootstrap: a connection authenticates within this time of its accept, or is dropped
    max_pending_control_connections: int = 32  # control and bootstrap, per port: connections not yet authenticated; one more drops the oldest idle one, or is refused when all are mid-handshake
    max_pending_connections_total: int = (
        64  # control and bootstrap together: connections not yet authenticated
    )
    peer_series_grace_s: float = (
        300.0  # a peer's labelled metric series are removed this long after its last session ended
    )
    secret_file: str = ""  # shared secret of peers and workers (never the secret itself)
    allow_insecure: bool = False  # true: serve without a shared secret (anyone reaching the ports may use it)
    allow_unauthenticated_engine: bool = False  # transport mooncake or nixl: accept that the engine's own listeners authenticate nobody (docs/security.md)
    curve_secret_key_file: str = ""  # CURVE secret key (Z85): encrypts the sockets this sidecar binds
    curve_server_key: str = ""  # CURVE public key of the sidecars it connects to (default: own)
    identity_key_file: str = ""  # this sidecar's own CURVE secret key (Z85), presented when it connects: its identity (pd-transfer identity)
    identity_allow_file: str = ""  # public key -> role, agent id, decode instance each sidecar may claim (checked of connecting sidecars, and of the prefills a decode connects to); unset: names are not checked
    integrity: bool = False  # crc32 every block sent; decode verifies (when both sides enable it)
    doorbell: bool = True  # same-host rooms also end through a shared-memory doorbell the worker's wait sleeps on (decode offers it, prefill rings it)
    copy_threads: int = field(
        default_factory=default_copy_threads
    )  # threads per shm write (raise it on a host with cores to spare)
    fault_corrupt_nth: int = 0  # TEST ONLY: flip a byte of this sidecar's nth data write (0: never)

    def __post_init__(self) -> None:
        if not self.agent_id:
            object.__setattr__(self, "agent_id", f"{self.role.value}-{os.getpid()}")
        if not self.worker_endpoint:
            object.__setattr__(self, "worker_endpoint", f"unix:///tmp/pd-transfer-{self.agent_id}.sock")

    @property
    def control_address(self) -> str:
        return f"tcp://{self.control_host}:{self.control_port}"


_FIELDS = {f.name: f for f in dataclasses.fields(SidecarConfig)}


def load_sidecar_config(
    path: str | None,
    overrides: dict[str, Any],
    environ: Mapping[str, str] | None = None,
    *,
    flags: Mapping[str, str] | None = None,
) -> SidecarConfig:
    """Defaults, then the file, then ``PD_TRANSFER_*`` variables, then flags.

    ``overrides`` are CLI flags by field (None meaning unset; ``flags``: field -> the flag
    that set it, which a problem then names). A variable names a field in upper case: ``PD_TRANSFER_CONTROL_PORT=5600``;
    lists are comma-separated. Every key of the file and every ``PD_TRANSFER_*`` variable is
    applied or reported (:mod:`pd_transfer.config.sources`).
    """
    settings: dict[str, Setting] = {}
    problems: list[str] = []
    if path:
        from_file, file_problems = file_settings(path, _FIELDS)
        settings.update(from_file)
        problems += file_problems
    kinds = {name: str(f.type) for name, f in _FIELDS.items()}
    from_env, env_problems = environ_settings(os.environ if environ is None else environ, kinds)
    settings.update(from_env)
    problems += env_problems
    settings.update(
        {
            name: Setting(value, flags[name] if flags else f"sidecar.{name}")
            for name, value in overrides.items()
            if value is not None
        }
    )
    return sidecar_config_from(settings, problems)


def render_toml(config: SidecarConfig) -> str:
    """The effective configuration as a ``[sidecar]`` table (``--print-config``)."""
    lines = ["[sidecar]"]
    for field_ in dataclasses.fields(SidecarConfig):
        value = getattr(config, field_.name)
        if isinstance(value, Role):
            value = value.value
        if isinstance(value, tuple):
            value = list(value)
        lines.append(f"{field_.name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def sidecar_config_from(settings: dict[str, Setting], problems: list[str] | None = None) -> SidecarConfig:
    """The config from checked settings; ConfigError listing every problem, each naming the
    value's origin (file and key, variable or flag) and what is accepted."""
    problems = list(problems or [])
    unknown: dict[str, list[str]] = {}
    for name, setting in settings.items():
        if name not in _FIELDS:
            unknown.setdefault(setting.origin.rpartition(".")[0] or "sidecar", []).append(name)
    for where, names in unknown.items():
        problems.append(
            f"{where}: unknown key(s) {sorted(names)}{_suggestions(names)}; accepted: {', '.join(_FIELDS)}"
        )
    clean: dict[str, Any] = {}
    for name, setting in settings.items():
        if name not in _FIELDS:
            continue
        found = _problems(name, setting.value)
        problems += [f"{setting.origin}{where}: {text}" for where, text in found]
        if found:
            continue
        if name == "role":
            clean[name] = Role(setting.value)
        else:
            clean[name] = tuple(setting.value) if isinstance(setting.value, list) else setting.value
    problems += _role_problems(settings, clean.get("role"))
    problems += _transport_problems(settings, clean.get("transport", "auto"))
    if "role" not in settings:
        problems.append(
            f"sidecar.role: required (prefill or decode): --role, role in [sidecar], or {ENV_PREFIX}ROLE"
        )
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"invalid sidecar config: {len(problems)} problem(s)\n{lines}")
    return SidecarConfig(**clean)


# settings only one role reads: given to the other, they would be ignored without a word
_ONE_ROLE_ONLY = {
    "instance_id": Role.DECODE,
    "prefill_bootstraps": Role.DECODE,
    "nixl_ucx_threads": Role.PREFILL,
}


def _role_problems(settings: dict[str, Setting], role: Role | None) -> list[str]:
    return [
        f"{settings[name].origin}: a {only.value} setting, which a {role.value} sidecar does not "
        f"read: remove it here, or set it on the {only.value} sidecars"
        for name, only in _ONE_ROLE_ONLY.items()
        if role is not None
        and role is not only
        and name in settings
        and settings[name].value not in ("", [], (), _FIELDS[name].default)
    ]


def _transport_problems(settings: dict[str, Setting], transport: str) -> list[str]:
    """A nixl setting given away from its default on a sidecar of another transport."""
    threads = settings.get("nixl_ucx_threads")
    if threads is None or threads.value == 1 or transport == "nixl":
        return []
    return [
        f"{threads.origin}: a transport nixl setting, which transport {transport!r} does not "
        f'read: remove it, or set transport = "nixl"'
    ]


def _suggestions(names: list[str]) -> str:
    pairs = [
        (name, difflib.get_close_matches(name, list(_FIELDS), n=1, cutoff=0.7)) for name in sorted(names)
    ]
    meant = [f"{name} -> {close[0]}" for name, close in pairs if close]
    return f" (did you mean {', '.join(meant)}?)" if meant else ""


def _problems(name: str, value: Any) -> list[tuple[str, str]]:
    """(where in the value, problem) pairs: ``[1]`` for the second address of a list."""
    problem = _check(name, value)
    if problem:
        return [("", problem)]
    if name == "prefill_bootstraps":
        return [
            (f"[{i}]", item_problem)
            for i, item in enumerate(value)
            if (item_problem := addresses.peer_address_problem(item))
        ]
    return []


def _check(name: str, value: Any) -> str:
    if name == "role":
        roles = [r.value for r in Role]
        return "" if value in roles else f"{value!r} is not one of {roles}"
    if name == "transport":
        if value not in TRANSPORTS:
            return f"{value!r} is not one of {list(TRANSPORTS)}"
        return engine_missing(value) if value in ENGINES else ""
    if name == "strategy":
        return "" if value in STRATEGIES else f"{value!r} is not one of {list(STRATEGIES)}"
    if name == "staging_slot_nbytes" and isinstance(value, int) and 0 < value < 4096:
        return f"must be at least 4096, got {value}"
    if name == "worker_endpoint" and isinstance(value, str) and value:
        return _endpoint_problem(value)
    if name == "mooncake_protocol":
        return "" if value in MOONCAKE_PROTOCOLS else f"{value!r} is not one of {list(MOONCAKE_PROTOCOLS)}"
    if name == "nixl_ucx_threads" and type(value) is int and not 1 <= value <= MAX_NIXL_UCX_THREADS:
        return (
            f"must be 1 to {MAX_NIXL_UCX_THREADS}, got {value}: 1 posts each write from the "
            "writing thread, more gives UCX that many worker threads (4 is vLLM's setting)"
        )
    kind = _FIELDS[name].type
    if kind == "bool":
        return "" if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if kind in ("int", "float"):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind == "int" and not isinstance(value, int))
        ):
            return f"expected {kind}, got {value!r}"
        if name.endswith("_port"):
            return addresses.port_problem(value)
        if value < 0 or (value == 0 and not name.startswith("fault_")):
            return f"must be positive, got {value}"
        return ""
    if kind == "str" and not isinstance(value, str):
        return f"expected a string, got {value!r}"
    if kind.startswith("tuple") and (
        not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value)
    ):
        return f"expected a list of addresses, got {value!r}"
    return _address_problem(name, value)


def _address_problem(name: str, value: Any) -> str:
    if name in addresses.HOST_FIELDS:
        return addresses.host_problem(name, value)
    if name == "bootstrap" and value:
        return addresses.peer_address_problem(value)
    return ""


WORKER_SCHEMES = ("unix://", "ipc://", "tcp://")


def _endpoint_problem(value: str) -> str:
    if value.startswith("tcp://"):
        return addresses.peer_address_problem(value)
    if not value.startswith(WORKER_SCHEMES):
        hint = (
            f": did you mean 'unix://{value}'?"
            if value.startswith("/")
            else " (e.g. unix:///run/pd-transfer/worker.sock)"
        )
        return f"{value!r} is not a unix://PATH, ipc://PATH or tcp://HOST:PORT address{hint}"
    try:
        unix_path(value)
    except ValueError as err:
        return str(err)
    return ""
