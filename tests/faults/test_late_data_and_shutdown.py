"""Over tcp, data of an aborted room is fenced out; at shutdown nothing is left behind.

Prefill TP 1 and decode TP 1 over the tcp data plane: the decode sidecar runs
a receiver that scatters chunks into its worker's regions. Each test gets a
deployment of its own (two of them shut theirs down). The late chunks are
sent by the test straight to the receiver's data port: a chunk that was on
its way when the room was aborted looks exactly like that.
"""

import os
import signal
import socket
import tomllib
from pathlib import Path

import numpy as np
import pytest
from fault_tools import changed_regions, kv_requests, segments_of, snapshot, tiny_ranks, wait_status

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.processes.ports import spare_port
from pd_transfer.transport.copy.packing import WireRuns
from pd_transfer.transport.tcp.frames import ChunkHeader, Fail, decode_reply, encode
from pd_transfer.transport.tcp.sockets import PREFIX, Kind, parse_address, prefix


@pytest.fixture
def cluster(deployment):
    # a fixed data port: the ready file is written before the worker registers, when the
    # receiver (started at registration) has no address yet; insecure, so that the test's
    # hand-made late chunk (no handshake) reaches the receiver's room checks
    return deployment(
        tiny_ranks(Role.PREFILL, 1),
        tiny_ranks(Role.DECODE, 1),
        transport="tcp",
        config={"allow_insecure": True},
        decode_config={"data_port": spare_port()},
    )


def _data_address(cluster) -> str:
    name = cluster.sidecars[cluster.decode[0].rank_id].name
    config = tomllib.loads((cluster.workdir / f"{name}.toml").read_text())["sidecar"]
    return f"tcp://127.0.0.1:{config['data_port']}"


def _late_chunk(address: str, room: int, generation: int, region: str, offset: int, nbytes: int):
    """A well-formed chunk of ``room`` sent straight to the decode receiver; its reply."""
    header = encode(
        ChunkHeader(
            xfer=4242,
            room=str(room),
            generation=generation,
            seq=0,
            wire=WireRuns((region,), np.array([[0, offset, nbytes]], dtype=np.int64)),
        )
    )
    with socket.create_connection(parse_address(address), timeout=5) as sock:
        sock.sendall(prefix(Kind.DATA, len(header), nbytes) + header + b"\xee" * nbytes)
        head = _recv_exactly(sock, PREFIX.size)  # the receiver did not answer if this times out
        return decode_reply(_recv_exactly(sock, PREFIX.unpack(head)[4]))


def _recv_exactly(sock, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        more = sock.recv(nbytes - len(data))
        assert more, "the receiver closed the connection without answering"
        data += more
    return data


def test_a_chunk_arriving_after_the_abort_is_refused_and_writes_nothing(cluster):
    prefill, decode = cluster.prefill[0].rank_id, cluster.decode[0]
    client = cluster.clients[decode.rank_id]
    client.expect(1, cluster.bootstrap, list(range(8)))
    wait_status(client, 1, [RoomStatus.WAITING_FOR_INPUT])
    before = snapshot(cluster, Role.DECODE)
    assert client.abort(1) is True  # drained: decode may reuse pages 0-7 now
    # prefill's worker sends the room anyway: the room is aborted there too
    cluster.clients[prefill].send(1, list(range(8)))
    assert cluster.clients[prefill].poll(1).code_text == "aborted"
    # a chunk of room 1 (generation 1: the first room of this decode sidecar) turns up late,
    # aimed at page 0 of the first KV view
    view = decode.views[0]
    reply = _late_chunk(_data_address(cluster), 1, 1, view.region, view.offset_nbytes, view.item_nbytes)
    assert isinstance(reply, Fail) and reply.code == "stale_generation", reply
    assert "room 1 generation 1 was aborted" in reply.text
    assert changed_regions(cluster, before) == []


def test_after_an_abort_the_next_room_lands_byte_exact(cluster):
    requests = kv_requests([2, 3, 4], [5, 0, 7])
    cluster.expect(2, requests)
    cluster.send(2, requests)
    assert cluster.wait_decode(2)[cluster.decode[0].rank_id].status is RoomStatus.SUCCESS
    assert cluster.verify(requests) == []


def test_a_chunk_of_a_room_decode_never_expected_is_refused(cluster):
    decode = cluster.decode[0]
    before = snapshot(cluster, Role.DECODE)
    view = decode.views[0]
    reply = _late_chunk(
        _data_address(cluster),
        999,
        1,
        view.region,
        view.offset_nbytes + 15 * view.item_nbytes,
        view.item_nbytes,
    )
    written = changed_regions(cluster, before)
    assert written == [] and isinstance(reply, Fail), (reply, written)


def test_sigterm_stops_every_sidecar_with_exit_0_leaving_no_segment(cluster):
    for client in cluster.clients.values():
        client.close()
    sidecars = list(cluster.sidecars.values())
    for sidecar in sidecars:
        sidecar.proc.send_signal(signal.SIGTERM)
    for sidecar in sidecars:
        assert sidecar.proc.wait(timeout=15) == 0, sidecar.log.read_text()[-2000:]
    assert segments_of(cluster)  # the workers' pools are still there: they own them
    for pools in cluster.pools.values():
        pools.close()
    assert segments_of(cluster) == []
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("pdt-") and cluster._tag in n]


def test_sigterm_removes_the_worker_endpoint_socket_file(cluster):
    for sidecar in cluster.sidecars.values():
        if sidecar.proc.poll() is None:
            sidecar.proc.send_signal(signal.SIGTERM)
            sidecar.proc.wait(timeout=15)
    left = [s.endpoint for s in cluster.sidecars.values() if Path(s.endpoint.split("://", 1)[1]).exists()]
    assert left == []
