"""A prefill room's chunks between different page sizes: each lands at its tokens.

``chunk_requests`` is pure; the room and target here are plain records with
the fields it reads, the planner a real one from two real instances.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pd_transfer.agent.prefill.chunks import chunk_requests
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.spans import TokenSpan
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.testing import World

sys.path.insert(0, str(Path(__file__).parents[1] / "layout"))
from transfer_check import instance  # noqa: E402


def _pair(kind="gqa", sizes=(16, 64)):
    prefill = instance(
        kind, Role.PREFILL, 1, page_size=sizes[0], num_pages=256 // sizes[0], num_swa_pages=256 // sizes[0]
    )
    decode = instance(
        kind,
        Role.DECODE,
        1,
        layout=Layout.PAGE_FIRST,
        page_size=sizes[1],
        num_pages=256 // sizes[1],
        num_swa_pages=256 // sizes[1],
    )
    return prefill, decode, PairPlanner(reconcile(prefill, decode), prefill[0], decode[0])


def _room(chunks, last=True):
    return SimpleNamespace(chunks=chunks, last_received=last)


def _target(planner, dst):
    return SimpleNamespace(peer=SimpleNamespace(planner=planner), dst=dst, kv_cursor=0, held=0)


def test_chunks_of_prefill_pages_land_at_their_tokens_in_larger_decode_pages():
    prefill, decode, planner = _pair()
    src, dst = np.array([9, 3, 0, 5, 7]), np.array([2, 1])  # 70 tokens: 5 x 16, 2 x 64
    room = _room([{Pool.KV: src[:3]}, {Pool.KV: src[3:]}])
    target = _target(planner, {Pool.KV: dst})
    world = World.build(prefill, decode, 1)
    first = chunk_requests(room, target, 0)[Pool.KV]
    assert (first.src_first_token, first.dst_first_token, first.dst_pages.tolist()) == (0, 0, [2])
    world.execute(planner.plan({Pool.KV: first}))
    target.kv_cursor = 3
    second = chunk_requests(room, target, 1)[Pool.KV]
    # tokens 48-79: the rest of decode page 2 and the start of page 1
    assert (second.src_first_token, second.dst_first_token, second.dst_pages.tolist()) == (48, 0, [2, 1])
    world.execute(planner.plan({Pool.KV: second}))
    assert world.verify({Pool.KV: (src, dst)}) == []


def test_a_last_chunk_whose_page_counts_no_token_count_fills_is_refused():
    _, _, planner = _pair()
    room = _room([{Pool.KV: np.array([0, 1, 2])}])
    with pytest.raises(PdTransferError) as err:
        chunk_requests(room, _target(planner, {Pool.KV: np.array([0, 1])}), 0)
    assert err.value.code is Reason.INDEX_COUNT_MISMATCH
    assert "3 kv page(s) of 16 tokens but decode allocated 2 of 64" in str(err.value)


def test_a_chunk_past_the_tokens_decode_allocated_is_refused_not_truncated():
    _, _, planner = _pair(sizes=(64, 16))
    room = _room([{Pool.KV: np.array([0, 1])}, {Pool.KV: np.array([2])}], last=False)
    with pytest.raises(PdTransferError) as err:
        chunk_requests(room, _target(planner, {Pool.KV: np.arange(5)}), 0)
    assert err.value.code is Reason.INDEX_COUNT_MISMATCH
    assert "prefill sends 128 tokens" in str(err.value)


def test_swa_window_pages_end_with_each_sides_last_kv_page():
    _, _, planner = _pair("swa", (16, 1))
    # 37 tokens: 3 prefill pages of 16, 37 decode pages of 1; the window's last pages
    chunk = {Pool.KV: np.arange(3), Pool.SWA: np.array([4, 6]), Pool.AUX: np.array([0])}
    target = _target(planner, {Pool.KV: np.arange(37), Pool.SWA: np.arange(9), Pool.AUX: np.array([1])})
    requests = chunk_requests(_room([chunk]), target, 0)
    swa = requests[Pool.SWA]
    assert isinstance(swa, TokenSpan)
    assert (swa.src_first_token, swa.dst_first_token) == (16, 28)  # 2 of 3 pages; 9 of 37
    assert list(requests)[-1] is Pool.AUX  # aux still lands last
