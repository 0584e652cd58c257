"""A stranger declaring a huge ZeroMQ frame on a sidecar's ports: dropped, counted, not held.

ZeroMQ buffers a frame whole before the application sees it. Every socket of
the sidecar caps the frame size (``MAXMSGSIZE``) at the protocol's frame limit
(16 MiB; 64 MiB on an ``ipc://`` worker endpoint), so a raw connection that
completes the ZeroMQ handshake, declares an 8 GiB frame and streams 160 MiB of
it (to the control and bootstrap ports, and to an ``ipc://`` worker endpoint)
is dropped at the frame header: the sidecar's peak memory (``VmHWM``) grows
by less than 48 MiB, and the end of the connection is counted in
``pd_transfer_connections_closed_total{socket}`` (scraped over HTTP).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from cluster import Cluster
from hostile_wire import (
    MiB,
    connection_dropped,
    host_port,
    rss_kib,
    send_oversized_frame,
    wait_for,
    zmtp_connect,
)
from secure_cluster import SECRET_HEX, metric, ranks, write_secret

from pd_transfer.layout.geometry import Role

DECLARED = 8 << 30  # the frame the stranger announces
STREAMED = 160 * MiB  # what it sends of it
BOUND_KIB = 48 * 1024  # the most the sidecar's peak RSS may grow meanwhile
CLOSED = "pd_transfer_connections_closed_total"


@pytest.fixture(scope="module")
def cluster():
    """Prefill and decode with a secret, serving their workers on ZeroMQ ``ipc://``."""
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    secret = write_secret(workdir, "secret", SECRET_HEX)
    made = Cluster(
        workdir,
        ranks(Role.PREFILL, 1),
        ranks(Role.DECODE, 1),
        attach=False,
        config={"secret_file": str(secret)},
        worker_scheme="ipc",
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PD_TRANSFER_SECRET_FILE", str(secret))
            made.attach_all()
        yield made
    finally:
        made.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _address(cluster, socket_name: str) -> tuple[str, int] | str:
    if socket_name == "bootstrap":
        return host_port(cluster.bootstrap)
    if socket_name == "worker":
        return cluster.sidecars["prefill[pp0,tp0]"].endpoint.removeprefix("ipc://")
    return host_port(cluster.ready["prefill[pp0,tp0]"]["control_address"])


@pytest.mark.parametrize("socket_name", ["control", "bootstrap", "worker"])
def test_an_8_gib_frame_is_dropped_at_its_header_and_counted(cluster, socket_name):
    rank = "prefill[pp0,tp0]"
    pid = cluster.sidecars[rank].proc.pid
    before = metric(cluster, rank, CLOSED, socket=socket_name)
    baseline = max(rss_kib(pid), rss_kib(pid, "VmHWM"))
    sock = zmtp_connect(_address(cluster, socket_name))
    try:
        sent = send_oversized_frame(sock, DECLARED, STREAMED)
        dropped = connection_dropped(sock)
    finally:
        sock.close()
    peak = rss_kib(pid, "VmHWM")
    assert peak - baseline < BOUND_KIB, (
        f"peak RSS grew by {(peak - baseline) // 1024} MiB while {sent // MiB} MiB were sent"
    )
    assert dropped and sent < STREAMED, f"the sidecar took {sent // MiB} MiB and kept the connection"
    wait_for(
        lambda: metric(cluster, rank, CLOSED, socket=socket_name) - before >= 1,
        5.0,
        f"the dropped {socket_name} connection counted",
    )
    assert cluster.sidecars[rank].proc.poll() is None
