"""The ``unix://`` worker endpoint (a plain Unix stream socket, the default) against
real sidecar processes: rooms over it and over ZeroMQ ``ipc://``, hostile bytes on
it, and the socket file's life."""

import asyncio
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
from cluster import Sidecar, random_requests, small_instances

from pd_transfer.cli import main as cli_main
from pd_transfer.client import AsyncClient, Client, RoomStatus
from pd_transfer.client.errors import Refused, ReplyTimeout, SidecarLost
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.protocol.stream_frames import MAX_FRAME_NBYTES, pack


def _pair(cluster_factory, **kwargs):
    prefill, decode = small_instances("llama-3.1-8b", 1, 2, Layout.NHD)
    cluster = cluster_factory(prefill, decode, **kwargs)
    requests = random_requests(prefill, decode, np.random.default_rng(3), pages=4)
    return cluster, requests


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_a_room_moves_byte_exact_over_either_kind_of_worker_endpoint(cluster_factory, scheme):
    cluster, requests = _pair(cluster_factory, worker_scheme=scheme)
    assert {s.endpoint.split("://")[0] for s in cluster.sidecars.values()} == {scheme}
    cluster.expect(5, requests)
    cluster.send(5, requests, chunk_pages=2)
    states = cluster.wait_decode(5)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []


def test_the_asyncio_client_waits_on_many_rooms_over_one_unix_connection(cluster_factory):
    cluster, _ = _pair(cluster_factory)
    # three live rooms at once: each its own destination pages and aux row (decode refuses
    # two live rooms on one page)
    dst_pages = np.random.default_rng(4).permutation(6)
    rooms = {21 + i: {Pool.KV: (np.array([0, 1]), dst_pages[2 * i : 2 * i + 2])} for i in range(3)}
    for i, room in enumerate((21, 22)):
        rooms[room][Pool.AUX] = (np.array([0]), np.array([i]))

    async def decode_side():
        clients = [
            AsyncClient(cluster.sidecars[g.rank_id].endpoint, f"aio-{g.rank_id}") for g in cluster.decode
        ]
        try:
            for room, requests in rooms.items():
                aux = requests.get(Pool.AUX)
                for client in clients:
                    await client.expect(
                        room,
                        cluster.bootstrap,
                        requests[Pool.KV][1],
                        aux_row=int(aux[1][0]) if aux is not None else None,
                    )
            waits = [client.wait(room, 20) for room in rooms for client in clients]
            sending = asyncio.to_thread(lambda: [cluster.send(room, r) for room, r in rooms.items()])
            *states, _ = await asyncio.gather(*waits, sending)
            return states
        finally:
            for client in clients:
                client.close()

    states = asyncio.run(decode_side())
    assert [s.status for s in states] == [RoomStatus.SUCCESS] * len(states), cluster.logs()
    assert cluster.verify(list(rooms.values())) == []


# -- one sidecar, hostile bytes ------------------------------------------------------------


def _lone(config: dict):
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    sidecar = Sidecar(workdir, "decode", "d0", {"http_port": 0, **config})
    ready = sidecar.wait_ready()
    yield sidecar, ready
    sidecar.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def lone():
    yield from _lone({})


@pytest.fixture
def lone_insecure():
    """Insecure on purpose: its raw frames reach the request parser, not the handshake."""
    yield from _lone({"allow_insecure": True})


def _path(sidecar) -> str:
    return sidecar.endpoint.removeprefix("unix://")


def _reply(sock: socket.socket) -> dict:
    header = _read(sock, 4)
    return msgpack.unpackb(_read(sock, struct.unpack("<I", header)[0]))


def _read(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        assert chunk, f"closed after {len(data)} of {nbytes} bytes"
        data += chunk
    return data


def _raw(sidecar) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(_path(sidecar))
    return sock


def _serves(sidecar) -> None:
    """A real client's call is answered (the sidecar has no worker: not_registered)."""
    with (
        Client(sidecar.endpoint, "probe", timeout_s=5) as client,
        pytest.raises(Refused, match="not_registered"),
    ):
        client.expect(1, "tcp://127.0.0.1:1", [0])


def _metric(ready: dict, line_start: str) -> float:
    with urllib.request.urlopen(ready["http_address"] + "/metrics", timeout=5) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


def test_the_socket_file_is_private_to_the_sidecars_user(lone):
    sidecar, _ = lone
    mode = os.lstat(_path(sidecar)).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_a_header_announcing_too_much_is_refused_and_the_endpoint_keeps_serving(lone):
    sidecar, ready = lone
    with _raw(sidecar) as sock:
        sock.sendall(struct.pack("<I", MAX_FRAME_NBYTES + 1))
        reply = _reply(sock)
        assert reply["ok"] is False and reply["code"] == "frame_too_large" and reply["id"] == -1
        assert str(MAX_FRAME_NBYTES) in reply["reason"]
        assert sock.recv(1) == b""  # closed: the stream cannot be read on after that
    assert _metric(ready, 'pd_transfer_bad_frames_total{reason="frame_too_large",role="decode"}') == 1
    _serves(sidecar)


def test_a_frame_that_is_not_msgpack_is_answered_and_the_connection_stays_usable(lone_insecure):
    sidecar, _ = lone_insecure
    with _raw(sidecar) as sock:
        sock.sendall(pack(b"\xc1 not msgpack"))
        reply = _reply(sock)
        assert reply["ok"] is False and reply["code"] == "bad_frame" and "msgpack" in reply["reason"]
        sock.sendall(pack(msgpack.packb({"op": "poll", "id": 7, "room": 1})))
        reply = _reply(sock)
        assert reply["id"] == 7 and reply["ok"] is False and reply["code"] == "not_registered"


def test_workers_gone_mid_frame_leave_the_endpoint_serving(lone):
    sidecar, _ = lone
    for cut in (2, 4, 40):  # inside the header, after it, inside the body
        with _raw(sidecar) as sock:
            sock.sendall(pack(msgpack.packb({"op": "poll", "id": 1, "room": 1, "pad": "x" * 64}))[:cut])
    _serves(sidecar)


def test_a_second_sidecar_on_a_served_path_refuses_to_start(lone):
    sidecar, _ = lone
    workdir = Path(_path(sidecar)).parent
    second = Sidecar(workdir, "decode", "d0", {"http_port": 0})  # the same endpoint path
    assert second.proc.wait(timeout=30) == 3
    assert "another process serves the worker endpoint" in second.log.read_text()
    assert _doorbells_of(second) == []  # a failed start removes what it made
    _serves(sidecar)


def _doorbells_of(sidecar) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if f"-doorbells-{sidecar.proc.pid}-" in name]


def test_a_file_that_is_not_a_socket_is_left_alone():
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    try:
        (workdir / "d1.sock").write_text("not a socket\n")
        sidecar = Sidecar(workdir, "decode", "d1", {"http_port": 0})
        assert sidecar.proc.wait(timeout=30) == 3
        assert "exists and is not a socket" in sidecar.log.read_text()
        assert _doorbells_of(sidecar) == []
        assert (workdir / "d1.sock").read_text() == "not a socket\n"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_stale_socket_file_left_by_a_crash_is_replaced():
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    try:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(workdir / "d2.sock"))
        stale.close()  # the file stays; nobody listens
        sidecar = Sidecar(workdir, "decode", "d2", {"http_port": 0})
        try:
            sidecar.wait_ready()
            _serves(sidecar)
        finally:
            sidecar.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_endpoint_path_too_long_for_a_unix_socket_is_a_config_error(capsys):
    endpoint = "unix:///tmp/" + "d" * 120 + "/w.sock"
    assert cli_main(["serve", "--role", "decode", "--worker-endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert "--worker-endpoint: " in err and "107" in err  # names the flag it came from


# -- the client's connection -------------------------------------------------------------


def test_a_client_waits_for_a_sidecar_that_starts_after_it():
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    holder = {}
    starter = threading.Timer(
        0.5, lambda: holder.setdefault("sidecar", Sidecar(workdir, "decode", "d3", {"http_port": 0}))
    )
    try:
        starter.start()
        with (
            Client(f"unix://{workdir}/d3.sock", "early", timeout_s=30) as client,
            pytest.raises(Refused, match="not_registered"),
        ):
            client.poll(1)
    finally:
        starter.join()
        holder["sidecar"].stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_call_to_no_sidecar_times_out_with_the_endpoint_named():
    started = time.monotonic()
    with (
        Client("unix:///tmp/pdt-nobody-here/w.sock", "alone", timeout_s=0.3) as client,
        pytest.raises(ReplyTimeout, match="pdt-nobody-here"),
    ):
        client.poll(1)
    assert time.monotonic() - started < 3


def test_an_asyncio_call_to_no_sidecar_times_out_with_the_endpoint_named():
    async def call():
        async with AsyncClient("unix:///tmp/pdt-nobody-here/w.sock", "alone", timeout_s=0.3) as client:
            with pytest.raises(ReplyTimeout, match="pdt-nobody-here"):
                await client.poll(1)

    started = time.monotonic()
    asyncio.run(call())
    assert time.monotonic() - started < 3


def _held_prefill_wait(cluster_factory, scheme="unix"):
    """A prefill room that waits for its decode side, which never asks: its wait is held."""
    cluster, requests = _pair(cluster_factory, worker_scheme=scheme)
    rank = cluster.prefill[0].rank_id
    cluster.clients[rank].send(9, list(requests[Pool.KV][0]), aux_row=int(requests[Pool.AUX][0][0]))
    return cluster, rank


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_a_sidecar_killed_during_a_wait_fails_the_wait_at_once(cluster_factory, scheme):
    cluster, rank = _held_prefill_wait(cluster_factory, scheme)
    threading.Timer(0.5, cluster.sidecars[rank].kill).start()
    started = time.monotonic()
    with pytest.raises(SidecarLost, match="closed the connection") as caught:
        cluster.clients[rank].wait(9, 30)
    assert time.monotonic() - started < 5
    assert caught.value.code.value == "peer_lost"


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_a_sidecar_killed_during_an_asyncio_wait_fails_it_at_once(cluster_factory, scheme):
    cluster, rank = _held_prefill_wait(cluster_factory, scheme)

    async def waiting():
        async with AsyncClient(cluster.sidecars[rank].endpoint, "aio-prefill") as client:
            asyncio.get_running_loop().call_later(0.5, cluster.sidecars[rank].kill)
            started = time.monotonic()
            with pytest.raises(SidecarLost, match="closed the connection"):
                await client.wait(9, 30)
            return time.monotonic() - started

    assert asyncio.run(waiting()) < 5


def _decode_waiting_on_its_doorbell(cluster_factory, scheme="unix"):
    """A decode room expected, never sent: its worker's wait sleeps on the doorbell."""
    cluster, requests = _pair(cluster_factory, worker_scheme=scheme)
    rank = cluster.decode[0].rank_id
    cluster.clients[rank].expect(
        8, cluster.bootstrap, requests[Pool.KV][1], aux_row=int(requests[Pool.AUX][1][0])
    )
    assert 8 in cluster.clients[rank]._bells._rooms, "the room has no doorbell to sleep on"
    return cluster, rank


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_a_decode_sidecar_killed_while_its_worker_sleeps_on_a_doorbell_fails_the_wait(
    cluster_factory, scheme
):
    cluster, rank = _decode_waiting_on_its_doorbell(cluster_factory, scheme)
    threading.Timer(0.5, cluster.sidecars[rank].kill).start()
    started = time.monotonic()
    with pytest.raises(SidecarLost, match="room 8 waited on its doorbell"):
        cluster.clients[rank].wait(8, 30)
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_the_same_for_an_asyncio_wait_on_a_doorbell(cluster_factory, scheme):
    cluster, rank = _decode_waiting_on_its_doorbell(cluster_factory, scheme)
    # the asyncio client below is this rank's worker now: it registers once the sidecar
    # let go of the registration of the client that closed
    cluster.clients[rank].close()
    deadline = time.monotonic() + 10
    while cluster.http(rank, "/readyz")[0] != 503 and time.monotonic() < deadline:
        time.sleep(0.02)
    requests = random_requests(cluster.prefill, cluster.decode, np.random.default_rng(3), pages=4)

    async def waiting():
        async with AsyncClient(cluster.sidecars[rank].endpoint, "aio-decode") as client:
            await client.register(cluster.decode[0], cluster.pools[rank].handles)
            await client.expect(
                9, cluster.bootstrap, requests[Pool.KV][1], aux_row=int(requests[Pool.AUX][1][0])
            )
            assert 9 in client._bells._rooms
            asyncio.get_running_loop().call_later(0.5, cluster.sidecars[rank].kill)
            started = time.monotonic()
            with pytest.raises(SidecarLost, match="closed the connection"):
                await client.wait(9, 30)
            return time.monotonic() - started

    assert asyncio.run(waiting()) < 3


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_an_idle_client_reaches_its_restarted_sidecar_on_the_next_call(cluster_factory, scheme):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
    from fault_tools import restart_sidecar

    cluster, _ = _pair(cluster_factory, worker_scheme=scheme)
    rank = cluster.decode[0].rank_id
    client = cluster.clients[rank]
    cluster.sidecars[rank].kill()
    restart_sidecar(cluster, rank)
    with pytest.raises(Refused, match="not_registered"):  # answered by the new sidecar
        client.poll(1)
    client.register(cluster.decode[0], cluster.pools[rank].handles)


def test_an_asyncio_client_closed_after_its_event_loop_closes_quietly(lone):
    sidecar, _ = lone
    client = AsyncClient(sidecar.endpoint, "late-close", timeout_s=5)
    loop = asyncio.new_event_loop()
    with pytest.raises(Refused, match="not_registered"):
        loop.run_until_complete(client.poll(1))  # connected: there is a transport to close
    loop.close()
    client.close()


def test_calls_to_a_sidecar_that_died_fail_as_gone_instead_of_each_waiting_its_timeout(cluster_factory):
    """An engine polling its rooms every step must not stall ``timeout_s`` (20 s here)
    per room on a dead sidecar: its path refused connections since it died."""
    cluster, _ = _pair(cluster_factory)
    rank = cluster.decode[0].rank_id
    sync_client = cluster.clients[rank]
    endpoint = cluster.sidecars[rank].endpoint

    async def async_polls(killed: asyncio.Event) -> list[str]:
        async with AsyncClient(endpoint, "async-worker", timeout_s=20) as client:
            with pytest.raises(Refused):  # connected: the sidecar answers (no registration)
                await client.poll(1)
            await killed.wait()
            errors = []
            for room in range(1, 4):
                with pytest.raises(SidecarLost) as caught:
                    await client.poll(room)
                errors.append(str(caught.value))
            return errors

    async def main() -> list[str]:
        killed = asyncio.Event()
        polls = asyncio.create_task(async_polls(killed))
        await asyncio.sleep(0.5)
        cluster.sidecars[rank].kill()
        cluster.sidecars[rank].proc.wait()
        killed.set()
        return await polls

    errors = asyncio.run(main())
    for room in range(1, 4):
        with pytest.raises(SidecarLost) as caught:
            sync_client.poll(room)
        errors.append(str(caught.value))
    path = endpoint.removeprefix("unix://")
    # each client's first call may see the connection break; the later ones find the path refusing
    for error in errors[1:3] + errors[4:]:
        assert f"the sidecar at {path} is gone" in error and "refuses connections since" in error, error
