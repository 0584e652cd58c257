"""Layer-wise streaming between real sidecars: each layer moves when announced, not before.

The prefill worker sends a room's chunks with ``stream=True`` before their KV
is "computed", then announces layers one by one. A layer's destination bytes
change only after it is announced; the room succeeds only after every layer
of every chunk is announced, and then the oracle finds every byte right.
"""

import time

import numpy as np
import pytest
from cluster import random_requests

from pd_transfer.agent.prefill.layers import span_of
from pd_transfer.client import Refused, RoomStatus
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool


def _instances(model: str, tp_src: int, tp_dst: int):
    spec = load_preset(model)
    common = dict(page_size=16, num_pages=6, num_slots=2, num_aux_rows=2, kv_layout=Layout.NHD)
    return build_instance(spec, Role.PREFILL, tp_src, **common), build_instance(
        spec, Role.DECODE, tp_dst, **common
    )


def _send_chunk(cluster, room: int, requests: dict, pages: slice, last: bool) -> None:
    src = {pool: idx for pool, (idx, _) in requests.items()}
    extra = (
        dict(
            state_slots=src.get(Pool.MAMBA, []),
            swa_pages=src.get(Pool.SWA, []),
            aux_row=int(src[Pool.AUX][0]) if Pool.AUX in src else None,
        )
        if last
        else {}
    )
    for geometry in cluster.prefill:
        cluster.clients[geometry.rank_id].send(
            room, list(src[Pool.KV][pages]), last_chunk=last, stream=True, **extra
        )


def _announce(cluster, room: int, layers) -> None:
    for geometry in cluster.prefill:
        for layer in layers:
            cluster.clients[geometry.rank_id].layer_ready(room, layer)


def _kv_regions(geometry, layer: int) -> list[str]:
    return [v.region for v in geometry.views if v.pool is Pool.KV and v.layer_id == layer]


def _snapshot(cluster) -> dict:
    return {
        (g.rank_id, r): a.copy() for g in cluster.decode for r, a in cluster.pools[g.rank_id].arrays.items()
    }


def _changed(cluster, before: dict, regions_of) -> bool:
    return any(
        not np.array_equal(cluster.pools[g.rank_id].arrays[r], before[(g.rank_id, r)])
        for g in cluster.decode
        for r in regions_of(g)
    )


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_streamed_hybrid_room_moves_layer_by_layer_and_lands_byte_exact(cluster_factory, transport):
    prefill, decode = _instances("qwen3-next-80b-a3b", 2, 4)
    cluster = cluster_factory(prefill, decode, transport=transport)
    requests = random_requests(prefill, decode, np.random.default_rng(5), pages=4)
    layers = sorted(span_of(prefill[0]))
    kv_layers = sorted({v.layer_id for v in prefill[0].views if v.pool is Pool.KV})
    first, later = kv_layers[0], kv_layers[1:]
    assert later  # more than one attention layer, or the checks below mean nothing

    def kv_of(layer_ids):
        return lambda g: [r for layer in layer_ids for r in _kv_regions(g, layer)]

    cluster.expect(21, requests)
    start = _snapshot(cluster)
    _send_chunk(cluster, 21, requests, slice(0, 2), last=False)
    time.sleep(0.3)
    assert not _changed(cluster, start, lambda g: [r.id for r in g.regions]), (
        "bytes landed before any layer was announced"
    )
    _announce(cluster, 21, layers)  # chunk 1: every layer, any order
    assert _wait_for(lambda: all(_changed(cluster, start, kv_of([layer])) for layer in kv_layers))
    time.sleep(0.2)
    middle = _snapshot(cluster)
    _send_chunk(cluster, 21, requests, slice(2, None), last=True)
    _announce(cluster, 21, [first])  # chunk 2 (the last): only its first attention layer so far
    assert _wait_for(lambda: _changed(cluster, middle, kv_of([first])))
    time.sleep(0.3)
    assert not _changed(cluster, middle, kv_of(later)), "an unannounced layer moved"
    for geometry in decode:
        assert cluster.clients[geometry.rank_id].poll(21).status is not RoomStatus.SUCCESS
    _announce(cluster, 21, [layer for layer in reversed(layers) if layer != first])
    states = cluster.wait_decode(21)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []


def test_layer_ready_outside_the_span_or_without_a_streamed_chunk_is_refused(cluster_factory):
    prefill, decode = _instances("llama-3.1-8b", 1, 1)
    cluster = cluster_factory(prefill, decode)
    client = cluster.clients[prefill[0].rank_id]
    requests = random_requests(prefill, decode, np.random.default_rng(1), pages=2)
    cluster.expect(5, requests)
    cluster.send(5, requests)  # not streamed
    with pytest.raises(Refused) as not_streamed:
        client.layer_ready(5, 0)
    assert not_streamed.value.code is Reason.UNKNOWN_ROOM
    assert "stream=True" in str(not_streamed.value) or "streamed" in str(not_streamed.value)
    with pytest.raises(Refused) as unknown:
        client.layer_ready(999, 0)
    assert unknown.value.code is Reason.UNKNOWN_ROOM
    assert all(s.status is RoomStatus.SUCCESS for s in cluster.wait_decode(5).values())
    # a streamed room: a layer id this rank does not have is refused, naming the span
    cluster.expect(6, requests)
    client.send(6, list(requests[Pool.KV][0]), aux_row=int(requests[Pool.AUX][0][0]), stream=True)
    with pytest.raises(Refused) as outside:
        client.layer_ready(6, 32)
    assert outside.value.code is Reason.BAD_FIELD and "0..31" in str(outside.value)
    _announce(cluster, 6, range(32))
    assert all(s.status is RoomStatus.SUCCESS for s in cluster.wait_decode(6).values())
    assert cluster.verify(requests) == []


def test_a_streamed_room_missing_layers_fails_with_a_timeout_not_a_hang(cluster_factory):
    prefill, decode = _instances("llama-3.1-8b", 1, 1)
    cluster = cluster_factory(prefill, decode, config={"transfer_timeout_s": 1.5})
    client = cluster.clients[prefill[0].rank_id]
    requests = random_requests(prefill, decode, np.random.default_rng(2), pages=2)
    cluster.expect(7, requests)
    client.send(7, list(requests[Pool.KV][0]), aux_row=int(requests[Pool.AUX][0][0]), stream=True)
    _announce(cluster, 7, range(31))  # layer 31 never comes
    state = cluster.clients[decode[0].rank_id].wait(7, 15)
    assert state.status is RoomStatus.FAILED and state.code is Reason.TIMEOUT, state
    assert client.wait(7, 5).status is RoomStatus.FAILED
