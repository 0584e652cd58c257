"""Sidecars move CUDA pools (CUDA IPC handles, torch device copies) byte-exact.

Each worker's pools are CUDA tensors (:func:`allocate_cuda_pools`); the
prefill sidecar opens the decode worker's handles and copies device to
device. Without a GPU these skip with the reason; the same sidecar paths on
host memory are covered by test_transfers.
"""

import numpy as np
import pytest
from cluster import random_requests, small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.layout.views import Layout
from pd_transfer.memory.cuda_ipc import cuda_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="no CUDA device on this machine"),
]

CASES = [
    ("llama-3.1-8b", 2, 4, Layout.NHD),
    ("deepseek-v3", 4, 2, Layout.NHD),
    ("qwen3-next-80b-a3b", 2, 4, Layout.HND),
]


def _move_and_check(cluster, prefill, decode, seed):
    requests = random_requests(prefill, decode, np.random.default_rng(seed), pages=4)
    cluster.expect(21, requests)
    cluster.send(21, requests, chunk_pages=2)
    states = cluster.wait_decode(21, timeout_s=60)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []


@pytest.mark.parametrize(
    "model,tp_src,tp_dst,layout", CASES, ids=[f"{m}-tp{a}to{b}-{lay.value}" for m, a, b, lay in CASES]
)
def test_cuda_pools_move_byte_exact_between_sidecars(cluster_factory, model, tp_src, tp_dst, layout):
    prefill, decode = small_instances(model, tp_src, tp_dst, layout)
    cluster = cluster_factory(prefill, decode, transport="auto", device="cuda")
    _move_and_check(cluster, prefill, decode, tp_src * 7 + tp_dst)
    status, text = cluster.http(prefill[0].rank_id, "/metrics")
    assert status == 200 and 'strategy="direct"' in text


@pytest.mark.parametrize("prefill_device,decode_device", [("cuda", "cpu"), ("cpu", "cuda")])
def test_cuda_pools_and_host_pools_exchange_on_one_host(cluster_factory, prefill_device, decode_device):
    prefill, decode = small_instances("llama-3.1-8b", 2, 4, Layout.NHD)
    cluster = cluster_factory(
        prefill, decode, transport="auto", device=prefill_device, decode_device=decode_device
    )
    _move_and_check(cluster, prefill, decode, 5)


def test_cuda_pools_over_tcp_are_rejected_at_registration_with_the_reason(cluster_factory):
    prefill, decode = small_instances("llama-3.1-8b", 2, 2, Layout.NHD)
    cluster = cluster_factory(prefill, decode, transport="tcp", device="cuda")
    requests = random_requests(prefill, decode, np.random.default_rng(1), pages=2)
    cluster.expect(22, requests)
    states = cluster.wait_decode(22, timeout_s=10)
    for state in states.values():
        assert state.status is RoomStatus.FAILED
        assert "CUDA memory" in state.reason, state
