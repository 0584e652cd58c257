"""A room belongs to the decode instance its prefill worker names (``send(..., decode=)``):
an authenticated decode of another instance that asks for it (before or after the rightful
one) is refused with ``not_room_owner``, receives nothing, and the rightful decode still
gets every byte."""

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from cluster import Cluster, Sidecar
from secure_cluster import ROOMS, ranks, requests, run_with, security

from pd_transfer.agent.channels import OutgoingChannel
from pd_transfer.client import Client, RoomStatus, allocate_pools
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import Close, Hello, Register

CONFIG = {"bootstrap_timeout_s": 5.0, "waiting_timeout_s": 8.0}


@pytest.fixture(scope="module")
def rooms(workdir):
    cluster = Cluster(
        workdir,
        ranks(Role.PREFILL, 1),
        ranks(Role.DECODE, 1),
        config=CONFIG,
        decode_config={"instance_id": "dec-A"},
    )
    geometry = ranks(Role.DECODE, 1)[0]
    stranger = Sidecar(
        workdir, "decode", "decode-stranger", {"http_port": 0, "instance_id": "dec-B", **CONFIG}
    )
    pools = None
    try:
        stranger.wait_ready()
        pools = allocate_pools(geometry, f"t-stranger-{id(cluster)}")
        client = Client(stranger.endpoint, "stranger", timeout_s=15)  # holds the secret
        client.register(geometry, pools.handles)
        cluster.stranger = client
        cluster.stranger_pools = pools
        yield cluster
        client.close()
    finally:
        stranger.stop()
        if pools is not None:
            pools.close()
        cluster.close()


def _dst(room: int) -> list[int]:
    return [int(i) for i in ROOMS[room][Pool.KV][1]]


def _send(cluster, room: int, decode: str) -> None:
    src = ROOMS[room]
    for geometry in cluster.prefill:
        cluster.clients[geometry.rank_id].send(
            room, src[Pool.KV][0], aux_row=int(src[Pool.AUX][0][0]), decode=decode
        )


def _prefill_knows(cluster, room: int, timeout_s: float = 15.0) -> None:
    """Wait until the prefill sidecar holds ``room`` (a decode's request for it arrived)."""
    rank = cluster.prefill[0].rank_id
    deadline = time.monotonic() + timeout_s
    while room not in [r["room"] for r in json.loads(cluster.http(rank, "/status")[1])["rooms"]]:
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.02)


def _stranger_untouched(cluster) -> bool:
    return all(not np.any(t.cpu().numpy()) for t in cluster.stranger_pools.tensors.values())


def test_a_stranger_asking_first_is_refused_and_the_rightful_decode_gets_every_byte(rooms):
    rooms.stranger.expect(1, rooms.bootstrap, _dst(1))  # the stranger asks first
    _prefill_knows(rooms, 1)
    rooms.expect(1, requests(1))  # then the rightful decode
    _send(rooms, 1, decode="dec-A")
    states = rooms.wait_decode(1, timeout_s=15)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, rooms.logs())
    assert rooms.verify_landed(1, requests(1)) == []
    refused = rooms.stranger.wait(1, timeout_s=15)
    assert refused.status is RoomStatus.FAILED and refused.code is Reason.NOT_ROOM_OWNER, refused
    assert "belongs to decode instance 'dec-A'" in refused.reason
    assert _stranger_untouched(rooms)


def test_a_stranger_asking_after_the_room_is_bound_is_refused_at_once(rooms):
    rooms.expect(2, requests(2))
    _send(rooms, 2, decode="dec-A")
    rooms.stranger.expect(2, rooms.bootstrap, _dst(2))
    refused = rooms.stranger.wait(2, timeout_s=15)
    assert refused.code is Reason.NOT_ROOM_OWNER, refused
    assert "not to 'dec-B'" in refused.reason
    states = rooms.wait_decode(2, timeout_s=15)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, rooms.logs())
    assert rooms.verify_landed(2, requests(2)) == []
    assert _stranger_untouched(rooms)


def test_a_decode_registering_under_another_name_than_it_proved_is_refused(rooms):
    """Rooms are bound to the names decode ranks register: a secret holder must register
    as the agent id its handshake proved."""
    secret = Path(os.environ["PD_TRANSFER_SECRET_FILE"]).read_text().strip()
    address = rooms.ready[rooms.prefill[0].rank_id]["control_address"]
    geometry = ranks(Role.DECODE, 1)[0]

    async def register_as_another(context):
        got = asyncio.Queue()
        channel = OutgoingChannel(context, address, Role.DECODE, "prefill 0")
        channel.start(lambda ch, message: got.put_nowait(message))
        try:
            await channel.send(Hello(agent_id="honest-name", role=Role.DECODE))
            assert isinstance(await asyncio.wait_for(got.get(), 10), Hello)
            await channel.send(
                Register(agent_id="someone-else", host_id="h", geometry=geometry, instance="dec-A")
            )
            while True:
                message = await asyncio.wait_for(got.get(), 10)
                if isinstance(message, Close):
                    return message
        finally:
            channel.close()

    closed = run_with(security(secret, agent_id="honest-name"), register_as_another)
    assert closed.reason is Reason.AUTH_FAILED
    assert "registered as 'someone-else' but authenticated as 'honest-name'" in closed.reason_text
