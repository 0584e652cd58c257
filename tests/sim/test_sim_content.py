"""The sim's deterministic content survives a real plan byte for byte, and nothing else does."""

from __future__ import annotations

import numpy as np
import pytest
from sim_models import instance

from pd_transfer.errors import GeometryError, PlanError
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.planner import plan_pair
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import AxisRole, Layout, Pool, ShardSpec
from pd_transfer.sim.content import (
    ViewContent,
    check_destination,
    fill_source,
    global_positions,
    verify_destination,
    window,
)
from pd_transfer.testing import runs

SEED = 1234


def _buffers(geometry):
    return {r.id: np.zeros(r.nbytes, np.uint8) for r in geometry.regions}


def _requests(prefill, decode, rng):
    """Distinct random indices for every pool both sides have."""
    requests = {}
    for pool in Pool:
        src_n = [v.index_count for g in prefill for v in g.views if v.pool is pool]
        dst_n = [v.index_count for g in decode for v in g.views if v.pool is pool]
        if src_n and dst_n:
            n = 1 if pool in (Pool.MAMBA, Pool.AUX) else min(min(src_n), min(dst_n)) // 2
            requests[pool] = (
                rng.choice(min(src_n), n, replace=False),
                rng.choice(min(dst_n), n, replace=False),
            )
    return requests


def _transfer(prefill, decode, requests):
    """Fill prefill with the sim content, run the real planner's runs, return decode buffers."""
    recon = reconcile(prefill, decode)
    recon.raise_if_rejected()
    src_buffers = {g.rank_id: _buffers(g) for g in prefill}
    for g in prefill:
        fill_source(g, src_buffers[g.rank_id], SEED)
    dst_buffers = {g.rank_id: _buffers(g) for g in decode}
    by_id = {g.rank_id: g for g in prefill}
    for dst in decode:
        for src_id in recon.sources_for(dst):
            plan = plan_pair(recon, by_id[src_id], dst, requests)
            for i, batch in enumerate(plan.batches):
                loaded = runs.load_runs(batch, f"batch {i}", src_buffers[src_id], dst_buffers[dst.rank_id])
                runs.copy_runs(
                    src_buffers[src_id][batch.src_region], dst_buffers[dst.rank_id][batch.dst_region], loaded
                )
    return dst_buffers


CASES = [
    ("gqa", 2, 4, Layout.NHD, Layout.NHD),
    ("gqa", 4, 2, Layout.NHD, Layout.NHD),
    ("gqa", 2, 2, Layout.HND, Layout.PAGE_FIRST),
    ("gqa2", 1, 4, Layout.NHD, Layout.NHD),
    ("mla", 4, 2, Layout.NHD, Layout.NHD),
    ("swa", 2, 4, Layout.NHD, Layout.PAGE_HEAD),
    ("gdn", 2, 4, Layout.NHD, Layout.NHD),
]


@pytest.mark.parametrize(
    ("kind", "prefill_tp", "decode_tp", "prefill_layout", "decode_layout"),
    CASES,
    ids=[f"{c[0]}-{c[1]}to{c[2]}-{c[3].value}-{c[4].value}" for c in CASES],
)
def test_check_destination_accepts_a_planned_transfer(
    kind, prefill_tp, decode_tp, prefill_layout, decode_layout
):
    prefill = instance(kind, Role.PREFILL, prefill_tp, layout=prefill_layout)
    decode = instance(kind, Role.DECODE, decode_tp, layout=decode_layout, num_pages=10)
    requests = _requests(prefill, decode, np.random.default_rng(7))
    dst_buffers = _transfer(prefill, decode, requests)
    for g in decode:
        assert check_destination(g, dst_buffers[g.rank_id], SEED, requests) == []


def test_check_destination_reports_one_corrupted_byte_with_its_coordinates():
    prefill = instance("gqa", Role.PREFILL, 2)
    decode = instance("gqa", Role.DECODE, 4)
    requests = {Pool.KV: (np.array([3, 5]), np.array([7, 1]))}
    dst_buffers = _transfer(prefill, decode, requests)
    rank = decode[1]
    view = next(v for v in rank.views if v.path == "kv.layer[1].v")
    # NHD [page, token, head, dim]: page 1, token 2, local head 0 (global head 1), dim 3, byte 1
    target = window(dst_buffers[rank.rank_id][view.region], view)
    target[1, 2, 0, 3] ^= np.uint16(0x0100)
    lines = check_destination(rank, dst_buffers[rank.rank_id], SEED, requests)
    assert len(lines) == 1
    assert lines[0].startswith(f"{rank.rank_id} kv.layer[1].v page dst=1 src=5: 1/")
    assert lines[0].endswith(
        "first at token=2 head=1 (global) head_dim=3: "
        f"got 0x{int(target[1, 2, 0, 3]):04x} "
        f"want 0x{int(target[1, 2, 0, 3]) ^ 0x0100:04x}"
    )
    for other in decode:
        if other is not rank:
            assert check_destination(other, dst_buffers[other.rank_id], SEED, requests) == []


def test_check_destination_rejects_an_earlier_requests_bytes():
    prefill = instance("gqa", Role.PREFILL, 1)
    decode = instance("gqa", Role.DECODE, 1)
    requests = {Pool.KV: (np.array([0, 1, 2]), np.array([2, 3, 4]))}
    dst_buffers = _transfer(prefill, decode, requests)
    result = verify_destination(decode[0], dst_buffers[decode[0].rank_id], SEED + 1, requests)
    assert result.items_wrong == 3 * 2 * 2  # 3 pages of K and V in 2 layers
    assert len(result.lines) == 12


def test_check_destination_caps_its_lines_and_counts_the_rest():
    decode = instance("gqa", Role.DECODE, 1, num_pages=40)
    buffers = _buffers(decode[0])
    pages = np.arange(30)
    result = verify_destination(decode[0], buffers, SEED, {Pool.KV: (pages, pages)}, max_lines=5)
    assert result.items_wrong == 30 * 4
    assert len(result.lines) == 6
    assert result.lines[-1] == "... 120 wrong items in total, first 5 shown"
    assert result.nbytes_checked == sum(v.item_nbytes for v in decode[0].views if v.pool is Pool.KV) * 30


def test_fill_source_writes_only_the_given_indices():
    geometry = instance("gdn", Role.PREFILL, 2)[0]
    buffers = _buffers(geometry)
    fill_source(geometry, buffers, SEED, {Pool.KV: [4], Pool.MAMBA: [1]})
    for view in geometry.views:
        data = window(buffers[view.region], view)
        index_axis = view.axis_index(AxisRole.INDEX)
        touched = np.moveaxis(data != 0, index_axis, 0).reshape(view.index_count, -1).any(axis=1)
        expected = {Pool.KV: [4], Pool.MAMBA: [1]}.get(view.pool, [])
        assert list(np.flatnonzero(touched)) == expected, view.path


def test_content_of_a_shard_is_the_slice_of_the_whole_tensor():
    """A tp=2 rank holds exactly heads [2,4) of what a tp=1 rank holds, by value."""
    whole = instance("gqa", Role.PREFILL, 1)[0]
    half = instance("gqa", Role.PREFILL, 2)[1]
    key = (Pool.KV, 0, "k")
    full = ViewContent.of(whole.view(key)).values_of(SEED, np.array([3]))
    part = ViewContent.of(half.view(key)).values_of(SEED, np.array([3]))
    np.testing.assert_array_equal(full[:, :, 2:4, :], part)


def test_every_item_and_every_seed_gets_its_own_content():
    view = instance("gqa", Role.PREFILL, 2)[0].view((Pool.KV, 1, "v"))
    content = ViewContent.of(view)
    items = content.values_of(SEED, np.arange(12)).reshape(12, -1)
    assert len({row.tobytes() for row in items}) == 12
    again = content.values_of(SEED + 1, np.arange(12)).reshape(12, -1)
    assert not np.any(np.all(items == again, axis=1))
    # within an item, elements differ by position too (not one repeated salt)
    assert np.unique(items[0]).size > items.shape[1] // 2


def test_global_positions_follow_shard_groups_in_order():
    shard = ShardSpec.grouped((4, 4, 8), ((2, 4), (2, 4), (4, 8)))
    assert global_positions(shard).tolist() == [2, 3, 6, 7, 12, 13, 14, 15]


def test_destination_indices_outside_the_pool_are_refused():
    geometry = instance("gqa", Role.DECODE, 1)[0]
    with pytest.raises(PlanError, match="destination index 12 is outside 0..11"):
        check_destination(geometry, _buffers(geometry), SEED, {Pool.KV: ([0], [12])})


def test_a_buffer_smaller_than_its_view_is_refused():
    geometry = instance("gqa", Role.DECODE, 1)[0]
    buffers = {r.id: np.zeros(r.nbytes - 1, np.uint8) for r in geometry.regions}
    with pytest.raises(GeometryError, match="reaches byte"):
        fill_source(geometry, buffers, SEED)
