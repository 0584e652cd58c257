"""Rooms that end before decode claims them end on prefill at once, and a lost prefill's rooms fail fast.

A decode worker that will never expect a room (its request ended first, or
cannot be loaded) calls ``abandon(room, bootstrap, reason)``: its sidecar
tells the prefill instance, whose room fails with ``aborted`` and decode's
reason, whether prefill's worker sent before or after, instead of waiting
in Bootstrapping for ``bootstrap_timeout_s``. A room another decode instance
asked for is not ended that way, and a room this decode rank expects is
aborted, not abandoned.

A prefill instance that was lost (its sidecar killed) fails a room claimed
afterwards within one heartbeat limit, with ``peer_lost``, instead of
waiting for its bootstrap address until ``bootstrap_timeout_s``.

Every timeout is far above the waits here, so no timeout can pass for these.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from cluster import Cluster, Sidecar

from pd_transfer.client import Refused
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.model_table import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.protocol import RoomStatus

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}
SLOW = {"bootstrap_timeout_s": 300.0, "waiting_timeout_s": 300.0, "transfer_timeout_s": 300.0}
WAIT_S = 30.0  # a generous bound, ten times below every timeout


def _ranks(role, tp):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 2}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


def _requests(pages):
    return {Pool.KV: (np.array(pages), np.array(pages)), Pool.AUX: (np.array([0]), np.array([1]))}


def _succeeds(cluster, room, pages):
    cluster.send(room, _requests(pages))
    cluster.expect(room, _requests(pages))
    for state in cluster.wait_decode(room, WAIT_S).values():
        assert state.status is RoomStatus.SUCCESS, cluster.logs()


def test_an_abandoned_room_fails_on_prefill_with_decodes_reason_whichever_comes_first(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 2), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, config=SLOW)
    decode_client = cluster.clients[decode[0].rank_id]
    # the prefill workers first (the room waits for a claim), before decode ever resolved prefill
    cluster.send(7, _requests([0, 1]))
    decode_client.abandon(7, cluster.bootstrap, "request r7 ended on decode before its claim")
    for g in prefill:
        state = cluster.clients[g.rank_id].wait(7, WAIT_S)
        assert state.status is RoomStatus.FAILED and state.code_text == "aborted", cluster.logs()
        assert "will never claim it: request r7 ended on decode before its claim" in state.reason
    # decode first: the prefill room fails before its worker sends, and the send finds it failed
    decode_client.abandon(8, cluster.bootstrap, "kv_transfer_params do not fit")
    for g in prefill:
        _wait_failed(cluster.clients[g.rank_id], 8)
    cluster.send(8, _requests([2, 3]))
    for g in prefill:
        state = cluster.clients[g.rank_id].wait(8, WAIT_S)
        assert state.status is RoomStatus.FAILED and "kv_transfer_params do not fit" in state.reason
    # the pair still serves
    _succeeds(cluster, 9, [4, 5])


def _wait_failed(client, room):
    """Until ``room`` exists on this prefill sidecar and failed (decode's word created it)."""
    for _ in range(int(WAIT_S / 0.02)):
        try:
            if client.poll(room).status is RoomStatus.FAILED:
                return
        except Refused:  # not known there yet
            pass
        time.sleep(0.02)
    raise AssertionError(f"room {room} did not fail on prefill")


def test_a_room_expected_here_is_aborted_not_abandoned(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, config=SLOW)
    cluster.expect(3, _requests([0, 1]))
    with pytest.raises(Refused, match="abort it instead"):
        cluster.clients[decode[0].rank_id].abandon(3, cluster.bootstrap, "ended")
    cluster.send(3, _requests([0, 1]))
    assert cluster.wait_decode(3, WAIT_S)[decode[0].rank_id].status is RoomStatus.SUCCESS


def test_another_decode_instance_cannot_abandon_a_room_a_decode_claimed(cluster_factory):
    prefill = _ranks(Role.PREFILL, 1)
    good = cluster_factory(prefill, _ranks(Role.DECODE, 1), config=SLOW)
    other = Cluster(good.workdir, [], _ranks(Role.DECODE, 1), config=SLOW)
    try:
        _succeeds(good, 1, [0, 1])
        other_client = other.clients[other.decode[0].rank_id]
        good.expect(3, _requests([2, 3]))
        _wait_claimed(good, 3)
        other_client.abandon(3, good.bootstrap, "not mine to end")
        # a room nobody claimed, after it on the same session: once it failed, room 3's word was read
        other_client.abandon(4, good.bootstrap, "unclaimed")
        _wait_failed(good.clients[prefill[0].rank_id], 4)
        good.send(3, _requests([2, 3]))
        assert good.wait_decode(3, WAIT_S)[good.decode[0].rank_id].status is RoomStatus.SUCCESS
        assert good.clients[prefill[0].rank_id].wait(3, WAIT_S).status is RoomStatus.SUCCESS
        assert good.verify([_requests([0, 1]), _requests([2, 3])]) == []
    finally:
        other.close()


def _wait_claimed(cluster, room):
    """Until prefill has decode's request for ``room`` (decode's room left Bootstrapping)."""
    client = cluster.clients[cluster.decode[0].rank_id]
    for _ in range(int(WAIT_S / 0.02)):
        if client.poll(room).status is not RoomStatus.BOOTSTRAPPING:
            return
        time.sleep(0.02)
    raise AssertionError(cluster.logs())


def test_a_room_of_a_lost_prefill_fails_within_a_heartbeat_limit(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, config=SLOW)
    _succeeds(cluster, 1, [0, 1])
    cluster.sidecars[prefill[0].rank_id].kill()
    cluster.expect(2, _requests([2, 3]))
    state = cluster.wait_decode(2, WAIT_S)[decode[0].rank_id]
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", cluster.logs()
    assert f"prefill instance {cluster.bootstrap} was lost" in state.reason
    assert "its rooms were lost with it" in state.reason
    # a prefill sidecar back at the address: its rooms are served, the loss is not held against it
    rank = prefill[0].rank_id
    cluster.clients.pop(rank).close()
    cluster.pools.pop(rank).close()
    old = cluster.sidecars[rank]
    config = {"transport": "shm", "http_port": 0, "heartbeat_interval_s": 0.2, "heartbeat_misses": 5, **SLOW}
    cluster.sidecars[rank] = Sidecar(
        cluster.workdir, "prefill", f"{old.name}-again", config, cluster.bootstrap
    )
    cluster.sidecars[rank].wait_ready()
    cluster._attach(prefill[0], "again")
    cluster.expect(3, _requests([4, 5]))
    cluster.send(3, _requests([4, 5]))
    assert cluster.wait_decode(3, WAIT_S)[decode[0].rank_id].status is RoomStatus.SUCCESS, cluster.logs()
    assert cluster.verify([_requests([0, 1]), _requests([4, 5])]) == []
