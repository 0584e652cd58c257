"""A decode that already holds a room's first pages (a prefix-cache hit) is written nothing into them.

Decode's worker expects the whole room with ``held_pages``: the first pages
of its list hold the room's tokens already. The oracle's ``verify`` is given
the room without those pages, so it checks both halves: every other page
holds prefill's bytes, and every byte of the held pages is exactly what
decode's worker had there (it flags any byte "the transfer must not
touch"). Equal page sizes (one chunk and chunk by chunk, over shm and tcp)
and different ones (prefill 4 tokens a page, decode 8: the held pages are
left out token for token). A held count beyond the room's pages is refused
with the field.
"""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.client import Refused, RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.model_table import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.spans import TokenSpan
from pd_transfer.layout.views import Layout, Pool

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}


def _ranks(role, page_size, num_pages):
    shape = {"page_size": page_size, "kv_layout": Layout.NHD, "num_pages": num_pages, "num_aux_rows": 2}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, 1, **shape)


def _expect(cluster, room, dst, held):
    client = cluster.clients[cluster.decode[0].rank_id]
    client.expect(room, cluster.bootstrap, dst, aux_row=1, held_pages=held)


def _send(cluster, room, src, chunk_pages):
    client = cluster.clients[cluster.prefill[0].rank_id]
    chunks = [src[i : i + chunk_pages] for i in range(0, len(src), chunk_pages)] if chunk_pages else [src]
    for chunk in chunks[:-1]:
        client.send(room, chunk, last_chunk=False)
    client.send(room, chunks[-1], aux_row=0)


@pytest.mark.parametrize(("transport", "chunk_pages"), [("shm", 0), ("tcp", 1), ("shm", 2)])
def test_held_pages_keep_decodes_bytes_and_the_rest_lands(cluster_factory, transport, chunk_pages):
    cluster = cluster_factory(_ranks(Role.PREFILL, 4, 8), _ranks(Role.DECODE, 4, 8), transport=transport)
    src, dst, held = [5, 1, 6, 2, 7], [3, 0, 7, 4, 6], 3
    _expect(cluster, 1, dst, held)
    _send(cluster, 1, src, chunk_pages)
    assert cluster.wait_decode(1)[cluster.decode[0].rank_id].status is RoomStatus.SUCCESS, cluster.logs()
    landed = {
        Pool.KV: (np.array(src[held:]), np.array(dst[held:])),
        Pool.AUX: (np.array([0]), np.array([1])),
    }
    assert cluster.verify(landed) == []


def test_held_pages_between_page_sizes_are_left_out_token_for_token(cluster_factory):
    # 22 tokens: 6 prefill pages of 4, 3 decode pages of 8; decode holds its first (tokens 0-7)
    cluster = cluster_factory(_ranks(Role.PREFILL, 4, 8), _ranks(Role.DECODE, 8, 4))
    src, dst = [7, 0, 5, 2, 6, 1], [2, 0, 3]
    _expect(cluster, 1, dst, 1)
    _send(cluster, 1, src, 2)  # chunks of 8 tokens: the first one is all held
    assert cluster.wait_decode(1)[cluster.decode[0].rank_id].status is RoomStatus.SUCCESS, cluster.logs()
    landed = {
        Pool.KV: TokenSpan(np.array(src), np.array(dst[1:]), 0, 8),
        Pool.AUX: (np.array([0]), np.array([1])),
    }
    assert cluster.verify(landed) == []


def test_more_held_pages_than_the_room_has_are_refused(cluster_factory):
    cluster = cluster_factory(_ranks(Role.PREFILL, 4, 8), _ranks(Role.DECODE, 4, 8))
    with pytest.raises(Refused, match="held_pages"):
        _expect(cluster, 1, [0, 1], 3)
