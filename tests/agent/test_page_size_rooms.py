"""Real sidecars move rooms between different page sizes byte-exact (checked by the oracle).

A small matrix: page sizes from {1, 16, 64} on each side, across device and
host layouts, both transports, a chunked room and SWA window pages, each pair
of sidecars moving two rooms. The bulk of the matrix (every layout pair) runs
without processes in tests/layout/test_page_sizes.py.
"""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.spans import TokenSpan
from pd_transfer.layout.views import Layout, Pool

sys.path.insert(0, str(Path(__file__).parents[1] / "layout"))
from transfer_check import small_model  # noqa: E402

TOKENS = 256  # tokens each side's pool holds (two rooms of up to 128 each)

CASES = [  # (model, prefill page size, decode page size, prefill layout, decode layout, transport)
    ("gqa", 16, 64, Layout.NHD, Layout.NHD, "shm"),
    ("gqa", 64, 1, Layout.HND, Layout.PAGE_HEAD, "tcp"),
    ("mla", 1, 16, Layout.NHD, Layout.PAGE_FIRST, "shm"),
    ("swa", 16, 1, Layout.PAGE_FIRST_DIRECT, Layout.LAYER_FIRST, "tcp"),
]


def _instance(kind, role, page_size, layout):
    pages = TOKENS // page_size
    return build_instance(
        small_model(kind),
        role,
        1,
        page_size=page_size,
        kv_layout=layout,
        num_pages=pages,
        num_swa_pages=pages,
        num_slots=2,
        num_aux_rows=2,
    )


def _rooms(rng, token_counts, sizes: tuple[int, int], with_swa: bool) -> list[dict]:
    """Rooms of these token counts on disjoint pages: each side's pages for the tokens and,
    for SWA, its last pages (the 8-token window plus the page it straddles)."""
    free = {pool: [list(rng.permutation(TOKENS // size)) for size in sizes] for pool in (Pool.KV, Pool.SWA)}

    def take(pool, side, n):
        taken, free[pool][side] = free[pool][side][:n], free[pool][side][n:]
        return np.array(taken, np.int64)

    rooms = []
    for row, tokens in enumerate(token_counts):
        counts = [math.ceil(tokens / size) for size in sizes]
        requests = {
            Pool.KV: (take(Pool.KV, 0, counts[0]), take(Pool.KV, 1, counts[1])),
            Pool.AUX: (np.array([row]), np.array([row])),
        }
        if with_swa:
            last = [min(count, math.ceil(8 / size) + 1) for count, size in zip(counts, sizes)]
            requests[Pool.SWA] = TokenSpan(
                take(Pool.SWA, 0, last[0]),
                take(Pool.SWA, 1, last[1]),
                (counts[0] - last[0]) * sizes[0],
                (counts[1] - last[1]) * sizes[1],
            )
        rooms.append(requests)
    return rooms


@pytest.mark.parametrize(
    "kind,src_pages,dst_pages,src_layout,dst_layout,transport",
    CASES,
    ids=[f"{c[0]}-{c[1]}x{c[2]}-{c[3].value}-{c[4].value}-{c[5]}" for c in CASES],
)
def test_sidecars_move_rooms_between_page_sizes(
    cluster_factory, kind, src_pages, dst_pages, src_layout, dst_layout, transport
):
    prefill = _instance(kind, Role.PREFILL, src_pages, src_layout)
    decode = _instance(kind, Role.DECODE, dst_pages, dst_layout)
    cluster = cluster_factory(prefill, decode, transport=transport)
    rng = np.random.default_rng(src_pages * 100 + dst_pages)
    # room 1: a partial last page, in one chunk; room 2: chunks of one prefill page
    first, second = _rooms(rng, (37, 70), (src_pages, dst_pages), kind == "swa")
    rooms = {1: (first, 0), 2: (second, 1)}
    for room, (requests, chunk_pages) in rooms.items():
        cluster.expect(room, requests)
        cluster.send(room, requests, chunk_pages=chunk_pages)
    for room in rooms:
        states = cluster.wait_decode(room)
        assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify([requests for requests, _ in rooms.values()]) == []
    # the oracle reads the landed bytes: one room alone leaves the other's bytes unexplained
    assert cluster.world.verify(rooms[1][0]) != []
