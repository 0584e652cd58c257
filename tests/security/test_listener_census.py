"""Every socket a sidecar listens on is one docs/security.md lists, bound where the table says.

For each transport (shm, tcp, tcp with CURVE, mooncake, nixl) a real prefill and
decode sidecar move a room; then each process's listening sockets are listed
from ``/proc`` (its own and every library's: all threads share one descriptor
table) and matched against the "Every listener" table of docs/security.md, parsed
here, so the doc and the sidecars cannot drift apart: a socket no row explains,
a row whose socket is missing, a socket bound elsewhere than its row says, or a
wildcard address no row admits fails the test. Each configured host differs
(data on 127.0.0.2, HTTP on 127.0.0.3), so a socket on the wrong one shows.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from cluster import Cluster, random_requests

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout
from pd_transfer.observability.listeners import Listener, listening, unix_listening
from pd_transfer.security.curve import SECRET_KEY_FILE, write_keys
from pd_transfer.transport.engines.interfaces import device_of
from pd_transfer.transport.engines.registry import engine_unusable

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
HOSTS = {"control_host": "127.0.0.1", "data_host": "127.0.0.2", "http_host": "127.0.0.3"}


@dataclass(frozen=True)
class Row:
    name: str
    transports: str
    roles: str
    binds: str

    def applies(self, transport: str, curve: bool, role: str) -> bool:
        if self.transports != "every":
            if transport not in re.findall(r"`(\w+)`", self.transports):
                return False
            if "(with CURVE)" in self.transports and not curve:
                return False
            if "(without CURVE)" in self.transports and curve:
                return False
        return self.roles == "both" or self.roles.startswith(role)  # "prefill rank 0": one rank here

    @property
    def engine(self) -> bool:
        return self.name.startswith(("Mooncake", "UCX"))


def documented_rows() -> list[Row]:
    """The rows of the "Every listener" table in docs/security.md."""
    section = DOC.read_text().split("## Every listener", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| Listener | Transports | Roles | Binds |"), lines[0]
    rows = []
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        rows.append(Row(*cells[:4]))
    return rows


def binds_as_documented(row: Row, listener: Listener, config: dict) -> bool:
    """Whether ``listener``'s address is the one ``row``'s "Binds" cell names."""
    binds = row.binds
    if "`0.0.0.0`" in binds or "`[::]`" in binds:
        return listener.host == ("0.0.0.0" if "`0.0.0.0`" in binds else "::")
    if "interface holding `data_host`" in binds:
        return device_of(listener.host) == device_of(config["data_host"])
    for field in ("control_host", "data_host", "http_host"):
        if f"`{field}`" in binds:
            return listener.host == config[field]
    if "`bootstrap`" in binds:
        return listener.host == urlsplit(config["bootstrap"]).hostname
    raise AssertionError(f"the census cannot read the Binds cell of {row.name!r}: {binds!r}")


def _port(address: str) -> int:
    return urlsplit(address).port


def census(cluster, rank_id: str, role: str, transport: str, curve: bool) -> list[str]:
    """What is wrong with one sidecar's listening sockets, against the documented rows."""
    sidecar = cluster.sidecars[rank_id]
    ready = cluster.ready[rank_id]
    status = json.loads(cluster.http(rank_id, "/status")[1])
    config = {**HOSTS, "bootstrap": cluster.bootstrap}
    rows = [row for row in documented_rows() if row.applies(transport, curve, role)]
    problems = []
    found = listening(sidecar.proc.pid)
    engine = {s for s in found if str(s) in status["engine_listeners"]}
    if {str(s) for s in engine} != set(status["engine_listeners"]):
        problems.append(f"/status reports engine listeners {status['engine_listeners']}, /proc shows {found}")
    by_row: dict[str, set[Listener]] = {}
    known_ports = {
        "control": _port(ready["control_address"]) if ready["control_address"] else None,
        "bootstrap": _port(cluster.bootstrap),
        "health and metrics HTTP": _port(ready["http_address"]),
    }
    for row in rows:
        if row.name == "worker endpoint":
            continue
        if row.name in known_ports:
            by_row[row.name] = {s for s in found if s.port == known_ports[row.name]}
        elif row.engine:
            by_row[row.name] = {s for s in engine if binds_as_documented(row, s, config)}
    explained = set().union(*by_row.values()) if by_row else set()
    ours = [
        row
        for row in rows
        if row.name not in known_ports and not row.engine and row.name != "worker endpoint"
    ]
    assert len(ours) <= 1, f"two data listeners documented for one sidecar: {ours}"
    for row in ours:  # decode's data port, tcp or engine staging: the rest of the sidecar's own
        by_row[row.name] = found - explained - engine
    for row in rows:
        if row.name == "worker endpoint":
            continue
        if not by_row.get(row.name):
            problems.append(f"{row.name}: documented, but no socket found among {sorted(map(str, found))}")
        for s in by_row.get(row.name, ()):
            if not binds_as_documented(row, s, config):
                problems.append(f"{row.name}: {s} is not bound where the doc says ({row.binds})")
    unexplained = found - set().union(*by_row.values())
    if unexplained:
        problems.append(f"listening sockets no documented row explains: {sorted(map(str, unexplained))}")
    for s in found:
        rows_of = [row.name for row in rows if s in by_row.get(row.name, ())]
        if s.wildcard and not any("every interface" in row.binds for row in rows if row.name in rows_of):
            problems.append(f"{s} binds every interface, which no row admits")
    # the worker endpoint: its socket file, mode 0600, and no other Unix listener
    path = sidecar.endpoint.split("://", 1)[1]
    if unix_listening(sidecar.proc.pid) != {path}:
        problems.append(f"Unix listeners {unix_listening(sidecar.proc.pid)}, documented: {{{path!r}}}")
    if stat.S_IMODE(os.stat(path).st_mode) != 0o600:
        problems.append(f"worker endpoint {path} has mode {oct(stat.S_IMODE(os.stat(path).st_mode))}")
    return problems


def _engine(name: str):
    return pytest.param(
        name, marks=pytest.mark.skipif(bool(engine_unusable(name)), reason=engine_unusable(name) or "-")
    )


@pytest.mark.parametrize("case", ["shm", "tcp", "tcp-curve", _engine("mooncake"), _engine("nixl")])
def test_every_listening_socket_is_documented_and_bound_where_the_doc_says(workdir, case):
    transport, curve = case.removesuffix("-curve"), case.endswith("-curve")
    config = dict(HOSTS)
    if curve:
        write_keys(str(workdir / "keys"), force=True)
        config["curve_secret_key_file"] = str(workdir / "keys" / SECRET_KEY_FILE)
    spec = load_preset("llama-3.1-8b")
    common = dict(page_size=16, num_pages=6, num_slots=2, num_aux_rows=2, kv_layout=Layout.NHD)
    prefill = build_instance(spec, Role.PREFILL, 1, **common)
    decode = build_instance(spec, Role.DECODE, 1, **common)
    cluster = Cluster(workdir, prefill, decode, transport=transport, config=config)
    try:
        _check(cluster, prefill, decode, transport, curve)
    finally:
        cluster.close()


def _check(cluster, prefill, decode, transport: str, curve: bool) -> None:
    requests = random_requests(prefill, decode, np.random.default_rng(3), pages=3)
    cluster.expect(31, requests)
    cluster.send(31, requests)
    states = cluster.wait_decode(31)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []
    problems = {
        rank.rank_id: census(cluster, rank.rank_id, rank.role.value, transport, curve)
        for rank in prefill + decode
    }
    assert problems == {rank.rank_id: [] for rank in prefill + decode}, cluster.logs()


def test_the_census_reads_every_row_of_the_table():
    rows = documented_rows()
    names = [row.name for row in rows]
    assert {"control", "bootstrap", "worker endpoint", "health and metrics HTTP", "tcp data"} <= set(names)
    assert {
        "Mooncake RPC",
        "Mooncake data",
        "UCX (NIXL)",
        "engine staging",
        "tcp data (ZeroMQ, CURVE)",
    } <= set(names)
    for row in rows:
        if row.name != "worker endpoint":  # each Binds cell is one the census can check
            binds_as_documented(row, Listener("127.0.0.2", 1), {**HOSTS, "bootstrap": "tcp://127.0.0.1:1"})
