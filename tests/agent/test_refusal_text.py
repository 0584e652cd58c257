"""A live refusal tells the operator what is wrong on both sides: the two models when they
differ, every mismatch, and the hint, in decode's failed room and prefill's /status."""

import json
import time

from cluster import small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.layout.views import Layout


def test_two_different_models_are_named_with_the_hint_on_both_sides(cluster_factory):
    prefill, _ = small_instances("llama-3.1-8b", 1, 1, Layout.NHD)
    _, decode = small_instances("nemotron-h-4b", 1, 1, Layout.NHD)
    cluster = cluster_factory(prefill, decode)
    d, p = decode[0].rank_id, prefill[0].rank_id
    cluster.clients[d].expect(1, cluster.bootstrap, [0])
    state = cluster.clients[d].wait(1, 30)
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_rejected", state
    headline = "cannot reconcile prefill (llama-3.1-8b, attn_tp=1) with decode (nemotron-h-4b, attn_tp=1)"
    assert headline in state.reason, state.reason
    deadline = time.monotonic() + 30
    while True:
        records = json.loads(cluster.http(p, "/status")[1])["peers"]
        reasons = [r["reason"] for r in records if r["state"] in ("rejected", "left")]
        if reasons or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reasons and headline in reasons[0] and "hint: " in reasons[0], records
