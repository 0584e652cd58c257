"""Failures end rooms with a reason, within bounded time, and sidecars keep serving."""

import time

import numpy as np

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}


def _ranks(role, tp, **kwargs):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 2, **kwargs}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


def _requests(n=3):
    return {Pool.KV: (np.arange(n), np.arange(n)[::-1].copy()), Pool.AUX: (np.array([0]), np.array([1]))}


def test_rejected_pair_fails_expect_within_a_second_with_the_diagnostic(cluster_factory):
    prefill = _ranks(Role.PREFILL, 2)
    decode = _ranks(Role.DECODE, 2, kv_dtype="float8_e4m3fn")
    cluster = cluster_factory(prefill, decode)
    client = cluster.clients[decode[0].rank_id]
    started = time.monotonic()
    client.expect(5, cluster.bootstrap, [0, 1])
    state = client.wait(5, timeout_s=5)
    assert time.monotonic() - started < 1.0
    assert state.status is RoomStatus.FAILED
    assert state.code_text == "peer_rejected"
    assert "kv.layer[0-1].k.dtype: prefill=bfloat16 decode=float8_e4m3fn" in state.reason
    assert "hint:" in state.reason


def test_a_rejected_peer_does_not_stop_prefill_serving_another(cluster_factory):
    prefill = _ranks(Role.PREFILL, 1)
    good = cluster_factory(prefill, _ranks(Role.DECODE, 1))
    bad_decode = _ranks(Role.DECODE, 1, kv_dtype="float8_e4m3fn")
    requests = _requests()
    # a second decode sidecar with a bad geometry talks to the same prefill instance
    from cluster import Cluster

    bad = Cluster(good.workdir, [], bad_decode)
    try:
        bad.clients[bad_decode[0].rank_id].expect(9, good.bootstrap, [0])
        assert bad.clients[bad_decode[0].rank_id].wait(9, 5).code_text == "peer_rejected"
        good.expect(1, requests)
        good.send(1, requests)
        assert good.wait_decode(1)[good.decode[0].rank_id].status is RoomStatus.SUCCESS
        assert good.verify(requests) == []
    finally:
        bad.close()


def test_decode_times_out_when_prefill_never_sends(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, config={"waiting_timeout_s": 0.6})
    cluster.expect(3, _requests())
    state = cluster.wait_decode(3, timeout_s=10)[decode[0].rank_id]
    assert state.status is RoomStatus.FAILED and state.code_text == "timeout"
    assert "timed out in waiting_for_input" in state.reason
    # prefill also gives up on a room whose worker never sends (where SGLang waits forever)
    prefill_state = cluster.clients[prefill[0].rank_id].wait(3, 10)
    assert prefill_state.status is RoomStatus.FAILED and prefill_state.code_text in ("timeout", "aborted")


def test_prefill_times_out_when_no_decode_request_arrives(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, config={"bootstrap_timeout_s": 0.8})
    client = cluster.clients[prefill[0].rank_id]
    client.send(4, [0, 1])
    state = client.wait(4, timeout_s=10)
    assert state.status is RoomStatus.FAILED and state.code_text == "timeout"
    assert "no transfer request from decode" in state.reason


def test_lost_prefill_sidecar_fails_rooms_naming_the_peer(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 2), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode)
    cluster.expect(8, _requests())
    client = cluster.clients[decode[0].rank_id]
    deadline = time.monotonic() + 5
    while client.poll(8).status is RoomStatus.BOOTSTRAPPING and time.monotonic() < deadline:
        time.sleep(0.02)
    cluster.sidecars[prefill[1].rank_id].kill()
    started = time.monotonic()
    state = client.wait(8, timeout_s=10)
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost"
    assert "prefill[pp0,tp1]" in state.reason
    assert time.monotonic() - started < 5 * 0.2 * 3  # a few heartbeat limits


def test_decode_abort_waits_for_the_drain_ack_and_fails_prefill(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode)
    cluster.expect(6, _requests())
    client = cluster.clients[decode[0].rank_id]
    deadline = time.monotonic() + 5
    while client.poll(6).status is RoomStatus.BOOTSTRAPPING and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.abort(6) is True  # drained: no write of the room can land any more
    assert client.poll(6).code_text == "aborted"
    prefill_state = cluster.clients[prefill[0].rank_id].wait(6, 5)
    assert prefill_state.status is RoomStatus.FAILED and prefill_state.code_text == "aborted"
    assert "aborted by decode" in prefill_state.reason


def test_prefill_shutdown_fails_live_rooms_with_a_reason_instead_of_a_hang(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode)
    requests = _requests()
    cluster.expect(12, requests)
    client = cluster.clients[decode[0].rank_id]
    deadline = time.monotonic() + 5
    while client.poll(12).status is RoomStatus.BOOTSTRAPPING and time.monotonic() < deadline:
        time.sleep(0.02)
    cluster.clients[prefill[0].rank_id].send(12, [0], last_chunk=False)  # the room is live
    cluster.sidecars[prefill[0].rank_id].stop()  # SIGTERM: drain, then fail what is left
    state = client.wait(12, timeout_s=15)
    assert state.status is RoomStatus.FAILED
    assert state.code_text == "shutting_down"
    assert "shut down" in state.reason


def test_a_room_id_an_earlier_decode_registration_used_is_refused_as_retired(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, config={"room_ttl_s": 300.0})
    rank = decode[0].rank_id
    cluster.expect(1, _requests())
    cluster.send(1, _requests())
    assert cluster.clients[rank].wait(1, 10).status is RoomStatus.SUCCESS
    cluster.clients[rank].close()  # the decode worker leaves; a new one registers
    deadline = time.monotonic() + 10
    while "register again" not in cluster.http(rank, "/readyz")[1]:
        assert time.monotonic() < deadline, cluster.http(rank, "/readyz")
        time.sleep(0.05)
    cluster.pools[rank].close()
    cluster._attach(decode[0], f"{cluster._tag}-again")
    cluster.expect(1, _requests())  # the same room id again
    state = cluster.clients[rank].wait(1, 10)
    assert state.status is RoomStatus.FAILED and state.code_text == "duplicate_room", state
    assert "another decode peer" not in state.reason  # it is the same rank, registered anew
    assert "room 1 was used by an earlier registration of decode[pp0,tp0]" in state.reason, state.reason
    assert "retired for room_ttl_s=300 s after it ended" in state.reason, state.reason
    cluster.expect(2, _requests())  # a new id is served
    cluster.send(2, _requests())
    assert cluster.clients[rank].wait(2, 10).status is RoomStatus.SUCCESS
