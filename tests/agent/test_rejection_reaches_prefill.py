"""A rejected decode rank tells the prefill rooms it would have claimed.

Decode fails such a room at once with the whole mismatch text; the prefill
side's room, which only a decode request names, fails with the same text
(code ``peer_rejected``) instead of waiting in Bootstrapping for its
``bootstrap_timeout_s`` (set far above the waits here, so a timeout cannot
pass for the refusal). Either order of the two workers' calls, and a second
room during the resolution's backoff, and never for a room another decode
instance holds.
"""

from __future__ import annotations

import time

import numpy as np
from cluster import Cluster

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
SLOW_BOOTSTRAP = {"bootstrap_timeout_s": 60.0}


def _ranks(role, tp, **kwargs):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 2, **kwargs}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


def _prefill_states(cluster, room):
    return [cluster.clients[g.rank_id].wait(room, timeout_s=20) for g in cluster.prefill]


def test_prefill_room_fails_with_decodes_text_whichever_worker_comes_first(cluster_factory):
    prefill = _ranks(Role.PREFILL, 2)
    decode = _ranks(Role.DECODE, 2, kv_dtype="float8_e4m3fn")
    cluster = cluster_factory(prefill, decode, config=SLOW_BOOTSTRAP)
    decode_client = cluster.clients[decode[0].rank_id]
    # the prefill worker first: its room waits for a request that a rejected decode never sends
    for g in prefill:
        cluster.clients[g.rank_id].send(5, [0, 1])
    decode_client.expect(5, cluster.bootstrap, [0, 1])
    decode_state = decode_client.wait(5, timeout_s=20)
    assert decode_state.code_text == "peer_rejected"
    assert "kv.layer[0-1].k.dtype: prefill=bfloat16 decode=float8_e4m3fn" in decode_state.reason
    for state in _prefill_states(cluster, 5):
        assert state.status is RoomStatus.FAILED and state.code_text == "peer_rejected", cluster.logs()
        assert state.reason == decode_state.reason
    # decode first (a later room, in the resolution's backoff): the prefill room fails
    # whether decode's word arrives before its worker's send or after
    decode_client.expect(6, cluster.bootstrap, [2, 3])
    decode_state = decode_client.wait(6, timeout_s=20)
    assert decode_state.code_text == "peer_rejected"
    for g in prefill:
        cluster.clients[g.rank_id].send(6, [2, 3])
    for state in _prefill_states(cluster, 6):
        assert state.status is RoomStatus.FAILED and state.code_text == "peer_rejected", state
        assert state.reason == decode_state.reason


def test_a_rejected_rank_cannot_fail_a_room_another_decode_holds(cluster_factory):
    prefill = _ranks(Role.PREFILL, 1)
    good = cluster_factory(prefill, _ranks(Role.DECODE, 1), config=SLOW_BOOTSTRAP)
    bad_decode = _ranks(Role.DECODE, 1, kv_dtype="float8_e4m3fn")
    bad = Cluster(good.workdir, [], bad_decode, config=SLOW_BOOTSTRAP)
    requests = {Pool.KV: (np.arange(3), np.arange(3)[::-1].copy()), Pool.AUX: (np.array([0]), np.array([1]))}
    try:
        good.expect(1, requests)
        decode_client = good.clients[good.decode[0].rank_id]
        deadline = time.monotonic() + 10  # the request reached prefill: the room has its target
        while decode_client.poll(1).status is RoomStatus.BOOTSTRAPPING and time.monotonic() < deadline:
            time.sleep(0.02)
        bad.clients[bad_decode[0].rank_id].expect(1, good.bootstrap, [0])
        assert bad.clients[bad_decode[0].rank_id].wait(1, 20).code_text == "peer_rejected"
        good.send(1, requests)
        assert good.wait_decode(1)[good.decode[0].rank_id].status is RoomStatus.SUCCESS
        assert good.clients[prefill[0].rank_id].wait(1, 20).status is RoomStatus.SUCCESS
        assert good.verify(requests) == []
    finally:
        bad.close()
