"""Requests outside the registered pools, duplicate rooms and intruding peers are refused.

Prefill TP 1 writes into decode TP 2 (sliced heads) over shared memory: the
prefill sidecar maps the decode segments and writes into them directly, the
path where a bad index would do the most harm. Guard bytes: before the
hostile rooms every byte of every decode region, and of a canary segment
nobody registered, is copied; afterwards each must be unchanged.

The intruder is the test itself on a raw DEALER speaking the protocol: it
says hello and registers a valid decode geometry, so the prefill sidecar
accepts it like any decode rank. Its two tests are expected to fail until
prefill checks a peer's region handles and binds a room to the decode
instance that asked for it first (issue 5, item 2).
"""

import json
import time

import numpy as np
import pytest
import zmq
from fault_tools import TERMINAL, changed_regions, kv_requests, snapshot, tiny_ranks, wait_status

from pd_transfer.client import Refused, RoomStatus, allocate_pools
from pd_transfer.config.sidecar import default_host_id
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.views import Pool
from pd_transfer.memory.segments import create_segment
from pd_transfer.protocol import (
    Done,
    Heartbeat,
    Hello,
    PoolIndices,
    RegionHandle,
    Register,
    TransferRequest,
    Verdict,
    decode,
    encode,
)

NUM_PAGES = 16


@pytest.fixture(scope="module")
def cluster(module_deployment):
    # insecure on purpose: the hostile peers here speak the protocol without the handshake,
    # to show what the sidecar refuses behind authentication (tests/security: in front of it)
    return module_deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 2, num_pages=NUM_PAGES),
        config={"allow_insecure": True},
    )


def _expect(cluster, room, pages):
    """Every decode rank expects ``room``; the refusals, where a sidecar refuses at once."""
    refusals = []
    for geometry in cluster.decode:
        try:
            cluster.clients[geometry.rank_id].expect(room, cluster.bootstrap, pages)
        except Refused as err:
            refusals.append(err)
    return refusals


def _send(cluster, room, pages):
    try:
        cluster.clients[cluster.prefill[0].rank_id].send(room, pages)
    except Refused as err:
        return err
    return None


def _outcomes(cluster, room) -> dict:
    """rank -> (status, code, reason) once terminal, for every rank that knows the room."""
    out = {}
    for rank_id, client in cluster.clients.items():
        try:
            state = wait_status(client, room, TERMINAL, timeout_s=10)
        except Refused:
            continue  # refused at the call: the room never existed there
        out[rank_id] = (state.status, state.code_text, state.reason)
    return out


def test_out_of_range_pages_are_refused_and_no_byte_is_written(cluster):
    with create_segment(f"pdt-t{cluster._tag}-canary", 1 << 16) as canary:
        canary.array[:] = 0xA5
        before = snapshot(cluster, Role.DECODE)
        assert before and all(np.any(a) for a in before.values())  # filled: a write would show

        # decode names page 19 of a 16-page pool: refused at the call, with the field
        refused_at_expect = _expect(cluster, 1, [0, 1, NUM_PAGES + 3])
        assert len(refused_at_expect) == len(cluster.decode)
        assert all(r.code_text == "index_out_of_range" for r in refused_at_expect)
        assert all(
            f"index {NUM_PAGES + 3} is outside" in r.reason and "$.pages[2]" in r.reason
            for r in refused_at_expect
        ), refused_at_expect

        # prefill names page 1000 of its 16-page pool
        _expect(cluster, 2, [4, 5, 6])
        refused_at_send = _send(cluster, 2, [0, 1, 1000])
        assert refused_at_send is None or refused_at_send.code_text == "index_out_of_range"
        outcomes = _outcomes(cluster, 2)
        for rank_id, (status, code, reason) in outcomes.items():
            assert status is RoomStatus.FAILED and code == "index_out_of_range", (rank_id, reason)
        assert any("index 1000 is outside" in reason for _, _, reason in outcomes.values())

        assert changed_regions(cluster, before) == []
        assert np.all(canary.array == 0xA5)
        canary.unlink()


def test_a_room_expected_twice_is_refused_and_the_first_still_lands(cluster):
    requests = kv_requests([3, 4, 5], [9, 2, 11])
    decode_client = cluster.clients[cluster.decode[0].rank_id]
    cluster.expect(3, requests)
    with pytest.raises(Refused) as err:
        decode_client.expect(3, cluster.bootstrap, [0, 1, 6])
    assert err.value.code_text == "duplicate_room" and "room 3 is already expected" in err.value.reason
    cluster.send(3, requests)
    assert all(s.status is RoomStatus.SUCCESS for s in cluster.wait_decode(3, 10).values())
    # byte-exact on both decode ranks, and nothing else written (the second expect's
    # pages 0, 1, 6, nor any page of the refused rooms of the other tests)
    assert cluster.verify_landed(3, requests) == []


# -- an intruding peer ------------------------------------------------------------------


class Intruder:
    """A raw decode peer on the prefill control socket."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.received = []

    def join(self, register: Register) -> Verdict | None:
        self.socket.send(encode(Hello(agent_id=register.agent_id, role=Role.DECODE)))
        self.socket.send(encode(register))
        return self.until(Verdict, 5.0)

    def join_with(self, agent_id: str, rank, pools) -> Verdict | None:
        """Register ``rank``'s geometry over pools of the intruder's own."""
        return self.join(
            Register(
                agent_id=agent_id,
                host_id=default_host_id(),
                geometry=rank,
                region_handles=tuple(RegionHandle(r, h) for r, h in pools.handles.items()),
            )
        )

    def until(self, kind, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            message = decode(self.socket.recv())
            self.received.append(message)
            if isinstance(message, kind):
                return message
        return None

    def send(self, message) -> None:
        self.socket.send(encode(message))

    def close(self) -> None:
        self.socket.close()


def test_peer_register_with_regions_sharing_a_segment_is_rejected(cluster):
    rank = cluster.decode[0]
    segments = cluster.pools[rank.rank_id].handles
    biggest = max(rank.regions, key=lambda r: r.nbytes).id
    intruder = Intruder(cluster.ready[cluster.prefill[0].rank_id]["control_address"])
    try:
        verdict = intruder.join(
            Register(
                agent_id="intruder-0",
                host_id=default_host_id(),
                geometry=rank,
                region_handles=tuple(RegionHandle(r.id, segments[biggest]) for r in rank.regions),
            )
        )
    finally:
        intruder.close()
    assert verdict is not None and not verdict.accepted
    assert verdict.mismatches[0].code is Reason.REGION_INVALID


def test_a_peer_cannot_join_the_room_of_another_peer(cluster):
    rank, prefill_rank = cluster.decode[0], cluster.prefill[0].rank_id
    own = allocate_pools(rank, f"t{cluster._tag}-intruder")
    intruder = Intruder(cluster.ready[prefill_rank]["control_address"])
    try:
        verdict = intruder.join_with("intruder-1", rank, own)
        assert verdict is not None and verdict.accepted  # a well-formed peer: accepted
        requests = kv_requests([1, 2, 3], [4, 5, 6])
        cluster.expect(9, requests)
        for geometry in cluster.decode:
            wait_status(cluster.clients[geometry.rank_id], 9, [RoomStatus.WAITING_FOR_INPUT])
        intruder.send(
            TransferRequest(
                room=9, generation=1, dst=(PoolIndices(Pool.KV, (4, 5, 6)),), src_ranks=(prefill_rank,)
            )
        )
        intruder.send(Heartbeat(agent_id="intruder-1", sequence=1, sent_unix_s=time.time()))
        intruder.until(Done, 0.3)  # a refusal would come back at once
        cluster.send(9, requests)
        assert all(s.status is RoomStatus.SUCCESS for s in cluster.wait_decode(9, 10).values())
        assert cluster.verify_landed(9, requests) == []
        done = next((m for m in intruder.received if isinstance(m, Done)), None) or intruder.until(Done, 2.0)
        written = {r: int(np.count_nonzero(a)) for r, a in own.arrays.items() if np.any(a)}
        assert written == {}, f"the victim's room was written into the intruder's regions: {written}"
        assert done is not None and done.reason is Reason.DUPLICATE_ROOM
    finally:
        intruder.close()
        own.close()


def test_a_peer_refused_over_a_bad_frame_fails_its_rooms_at_once(cluster):
    """Prefill answers a bad frame with a Close: the session is over, and the rooms it
    asked for fail right then with the refusal, instead of at their timeout."""
    rank, prefill_rank = cluster.decode[0], cluster.prefill[0].rank_id
    prefill = cluster.clients[prefill_rank]
    own = allocate_pools(rank, f"t{cluster._tag}-refused")
    intruder = Intruder(cluster.ready[prefill_rank]["control_address"])
    try:
        verdict = intruder.join_with("refused-0", rank, own)
        assert verdict is not None and verdict.accepted
        intruder.send(
            TransferRequest(
                room=21, generation=1, dst=(PoolIndices(Pool.KV, (1, 2)),), src_ranks=(prefill_rank,)
            )
        )
        # (bootstrapping: prefill waits for the other decode rank's request too)
        wait_status(prefill, 21, [RoomStatus.BOOTSTRAPPING, RoomStatus.WAITING_FOR_INPUT], 5)
        intruder.socket.send(b"\xc1")  # no msgpack at all
        state = wait_status(prefill, 21, TERMINAL, timeout_s=2)
        assert state.status is RoomStatus.FAILED and state.code_text == "bad_frame"
        assert "session closed after a bad frame" in state.reason
        status = json.loads(cluster.http(prefill_rank, "/status")[1])
        record = next(p for p in status["peers"] if p["peer"] == rank.rank_id and "bad frame" in p["reason"])
        assert record["state"] == "lost"
    finally:
        intruder.close()
        own.close()
