"""Sidecar processes move a room through the optional engines (mooncake, nixl), byte-exact.

Each case runs only where its engine is installed; skipped with the pip extra to
install elsewhere. The decode sidecar registers its regions with the engine and
publishes them in its Register; the prefill sidecar writes through the engine.
Both report, per decode peer and pool, whether the pool moves as direct runs or
staged (the Verdict's plan summary, ``pd_transfer_strategy``).
"""

import re

import numpy as np
import pytest
from cluster import random_requests

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout
from pd_transfer.transport.engines.registry import ENGINES, engine_unusable

ENGINE_PARAMS = [
    pytest.param(e, marks=pytest.mark.skipif(bool(engine_unusable(e)), reason=engine_unusable(e) or "-"))
    for e in ENGINES
]
_STRATEGY = re.compile(r"^pd_transfer_strategy\{([^}]*)\} (\S+)$", re.M)


def _sliced_pair(page_size: int = 16):
    spec = load_preset("llama-3.1-8b")
    common = dict(page_size=page_size, num_pages=6, num_slots=2, num_aux_rows=2, kv_layout=Layout.NHD)
    return (build_instance(spec, Role.PREFILL, 2, **common), build_instance(spec, Role.DECODE, 4, **common))


def _move_a_room(cluster, prefill, decode, room: int) -> None:
    requests = random_requests(prefill, decode, np.random.default_rng(5), pages=4)
    cluster.expect(room, requests)
    cluster.send(room, requests, chunk_pages=2)
    states = cluster.wait_decode(room)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []


def _strategies(cluster, rank_id: str) -> dict[tuple[str, str], str]:
    """``{(peer, pool): strategy}`` whose pd_transfer_strategy gauge is 1 on ``rank_id``."""
    status, text = cluster.http(rank_id, "/metrics")
    assert status == 200
    chosen = {}
    for labels, value in _STRATEGY.findall(text):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if float(value) == 1:
            key = (fields["peer"], fields["pool"])
            assert key not in chosen, f"two strategies for {key} on {rank_id}"
            chosen[key] = fields["strategy"]
    return chosen


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_sidecars_move_a_sliced_room_through_an_engine(cluster_factory, engine):
    prefill, decode = _sliced_pair()
    cluster = cluster_factory(prefill, decode, transport=engine)
    _move_a_room(cluster, prefill, decode, 21)


@pytest.mark.parametrize("strategy", ["staged", "auto"])
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_the_verdict_and_metrics_report_each_pools_strategy(cluster_factory, engine, strategy):
    prefill, decode = _sliced_pair()
    cluster = cluster_factory(prefill, decode, transport=engine, config={"strategy": strategy})
    _move_a_room(cluster, prefill, decode, 22)
    # (prefill rank, decode rank, pool) -> strategy: as prefill chose it, as decode read it
    chosen = {
        (p.rank_id, peer, pool): s
        for p in prefill
        for (peer, pool), s in _strategies(cluster, p.rank_id).items()
    }
    read = {
        (peer, d.rank_id, pool): s
        for d in decode
        for (peer, pool), s in _strategies(cluster, d.rank_id).items()
    }
    assert chosen == read and {pool for _, _, pool in chosen} == {"kv", "aux"}, cluster.logs()
    assert {d for _, d, _ in chosen} == {d.rank_id for d in decode}
    assert (
        set(chosen.values()) == {"staged"}
        if strategy == "staged"
        else set(chosen.values()) <= {"direct", "staged"}
    )


def test_tcp_reports_staged_and_shm_direct(cluster_factory):
    prefill, decode = _sliced_pair()
    for transport, expected in (("tcp", "staged"), ("shm", "direct")):
        cluster = cluster_factory(prefill, decode, transport=transport)
        _move_a_room(cluster, prefill, decode, 23)
        assert set(_strategies(cluster, decode[0].rank_id).values()) == {expected}


@pytest.mark.skipif(bool(engine_unusable("nixl")), reason=engine_unusable("nixl") or "-")
def test_prefill_sidecars_with_four_ucx_threads_move_a_room_through_nixl(cluster_factory):
    # nixl_ucx_threads is a prefill setting: the decode sidecars keep the default
    prefill, decode = _sliced_pair()
    cluster = cluster_factory(
        prefill,
        decode,
        transport="nixl",
        config={"nixl_ucx_threads": 4},
        decode_config={"nixl_ucx_threads": 1},
    )
    _move_a_room(cluster, prefill, decode, 24)
