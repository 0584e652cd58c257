"""Real sidecar processes move real models' state byte-exact (checked by the oracle)."""

import numpy as np
import pytest
from cluster import random_requests, small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.layout.views import Layout

TRANSPORTS = ["shm", "tcp"]

CASES = [
    ("llama-3.1-8b", 2, 4, Layout.NHD),
    ("llama-3.1-8b", 4, 2, Layout.HND),
    ("deepseek-v3", 4, 2, Layout.NHD),
    ("qwen3-next-80b-a3b", 2, 4, Layout.NHD),
    ("gpt-oss-20b", 2, 4, Layout.NHD),
    ("llama-3.1-8b", 2, 1, Layout.PAGE_FIRST),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "model,tp_src,tp_dst,layout", CASES, ids=[f"{m}-tp{a}to{b}-{lay.value}" for m, a, b, lay in CASES]
)
def test_sidecars_move_a_room_byte_exact(cluster_factory, model, tp_src, tp_dst, layout, transport):
    prefill, decode = small_instances(model, tp_src, tp_dst, layout)
    cluster = cluster_factory(prefill, decode, transport=transport)
    requests = random_requests(prefill, decode, np.random.default_rng(tp_src * 7 + tp_dst), pages=4)
    cluster.expect(11, requests)
    cluster.send(11, requests, chunk_pages=2)
    states = cluster.wait_decode(11)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []
    for geometry in prefill:  # the prefill worker sees its side finish too
        assert cluster.clients[geometry.rank_id].wait(11, 5).status is RoomStatus.SUCCESS
