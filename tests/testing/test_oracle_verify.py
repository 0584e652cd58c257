"""World.execute and World.verify against hand-written plans, right and wrong."""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.errors import PlanError
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.views import Pool
from pd_transfer.testing import World, runs

BF16 = 2
SRC_PAGES, DST_PAGES = np.array([0, 3, 5]), np.array([4, 1, 2])
REQUEST = {Pool.KV: (SRC_PAGES, DST_PAGES)}


@pytest.fixture
def tp1(kit):
    """TP1 -> TP1 with identical NHD layouts, and a correct page-copy plan."""
    src, dst = kit.nhd_rank(Role.PREFILL, 1, 0), kit.nhd_rank(Role.DECODE, 1, 0, num_pages=8)
    world = World.build([src], [dst], seed=11)
    return world, kit.page_copy_plan(src, dst, SRC_PAGES, DST_PAGES), dst


def test_identical_layout_page_copy_is_byte_exact(tp1):
    world, plan, _ = tp1
    world.execute(plan)
    assert world.verify(REQUEST) == []
    world.assert_exact(REQUEST)


def test_verify_reports_a_corrupted_byte_in_a_requested_page(tp1):
    world, plan, dst = tp1
    world.execute(plan)
    view = dst.views[2]  # layer 1 k
    at = view.offset_nbytes + 1 * view.strides_nbytes[0] + 3 * view.strides_nbytes[2] + 1
    world.decode_buffers[dst.rank_id]["kv"][at] ^= 0xFF
    lines = world.verify(REQUEST)
    assert len(lines) == 1
    assert lines[0].startswith(
        "decode[pp0,tp0] kv.layer[1].k page dst=1 src=3: 1/128 bytes "
        "differ, first at token=0 head=3 (global) dim=0 byte=1"
    )


def test_verify_reports_a_write_into_a_page_nobody_requested(tp1):
    world, plan, dst = tp1
    world.execute(plan)
    view = dst.views[1]  # layer 0 v, page 7 was not requested
    world.decode_buffers[dst.rank_id]["kv"][view.offset_nbytes + 7 * view.strides_nbytes[0]] += 1
    lines = world.verify(REQUEST)
    assert len(lines) == 1
    assert "1 byte(s) changed that the transfer must not touch" in lines[0]
    assert "kv.layer[0].v[page=7, token=0, head=0, dim=0, byte=0]" in lines[0]


def test_verify_reports_a_write_into_padding_between_views(tp1, kit):
    world, plan, dst = tp1
    world.execute(plan)
    gap = dst.views[1].offset_nbytes - kit.PAD_NBYTES
    world.decode_buffers[dst.rank_id]["kv"][gap] += 1
    assert "outside every registered view" in world.verify(REQUEST)[0]


def test_verify_reports_an_omitted_run(tp1):
    world, plan, _ = tp1
    first = plan.batches[0]
    first.src_offset, first.dst_offset, first.nbytes = (a[1:] for a in first.byte_runs())
    world.execute(plan)
    lines = world.verify(REQUEST)
    assert len(lines) == 1
    assert lines[0].startswith("decode[pp0,tp0] kv.layer[0].k page dst=4 src=0:")


def test_verify_reports_a_changed_prefill_byte(tp1):
    world, plan, _ = tp1
    world.execute(plan)
    world.prefill_buffers["prefill[pp0,tp0]"]["kv"][5] += 1
    lines = world.verify(REQUEST)
    assert len(lines) == 1 and lines[0].startswith("prefill[pp0,tp0] region 'kv': 1 byte(s) changed")


def test_verify_reports_bytes_written_by_two_plans(tp1):
    world, plan, _ = tp1
    world.execute(plan)
    world.execute(plan)  # a second writer copies identical bytes: only the oracle's count sees it
    lines = world.verify(REQUEST)
    assert lines == [
        "plan prefill[pp0,tp0] -> decode[pp0,tp0]: 1536 byte(s) of region 'kv' were "
        "already written by an earlier plan, first at byte 512 (one writer must be "
        "elected)"
    ]  # 3 pages x 4 buffers x 128 bytes; page 4 of layer 0 k first


def test_verify_reports_overlapping_runs_within_one_plan(tp1, kit):
    world, plan, dst = tp1
    plan.batches.append(kit.batch("kv", "kv", [0], [dst.views[0].offset_nbytes + 4 * 128 + 4], 8))
    world.execute(plan)
    assert any(
        "write destination bytes another run of the same plan writes" in line
        for line in world.verify(REQUEST)
    )


def test_verify_caps_its_lines_and_counts_the_rest(tp1):
    world, _, dst = tp1
    world.decode_buffers[dst.rank_id]["kv"][:] += 1  # every page of every view is now wrong
    lines = world.verify({Pool.KV: (np.arange(6), np.arange(6))})
    assert len(lines) == 21
    assert lines[-1] == "... 25 discrepancies in total, first 20 shown"  # 4 views x 6 pages + 1 region


def test_assert_exact_raises_with_the_discrepancies(tp1):
    world, _, _ = tp1
    with pytest.raises(AssertionError, match="not byte-exact:\n  decode"):
        world.assert_exact(REQUEST)


def test_execute_refuses_an_out_of_bounds_run_and_copies_nothing(tp1, kit):
    world, plan, dst = tp1
    size = dst.regions[0].nbytes
    plan.batches.append(kit.batch("kv", "kv", [0], [size - 4], 8))
    with pytest.raises(PlanError, match="out of bounds of destination region 'kv'"):
        world.execute(plan)
    assert world.verify({}) == []


@pytest.mark.parametrize("src, dst, nbytes", [([-1], [0], 4), ([0], [0], -4), ([10**6], [0], 1)])
def test_execute_refuses_negative_or_far_runs(tp1, kit, src, dst, nbytes):
    world, plan, _ = tp1
    plan.batches = [kit.batch("kv", "kv", src, dst, nbytes)]
    with pytest.raises(PlanError, match="out of bounds"):
        world.execute(plan)


def test_execute_refuses_an_unknown_region_or_rank(tp1, kit):
    world, plan, _ = tp1
    plan.batches = [kit.batch("kv", "nope", [0], [0], 4)]
    with pytest.raises(PlanError, match="destination region 'nope' is not registered"):
        world.execute(plan)
    plan.dst_rank = "decode[pp0,tp9]"
    with pytest.raises(PlanError, match="unknown decode rank"):
        world.execute(plan)


def test_verify_refuses_malformed_requests(tp1):
    world, _, _ = tp1
    with pytest.raises(PlanError, match="destination indices repeat"):
        world.verify({Pool.KV: (np.array([0, 1]), np.array([2, 2]))})
    with pytest.raises(PlanError, match="destination index 8 is outside 0..7"):
        world.verify({Pool.KV: (np.array([0]), np.array([8]))})
    with pytest.raises(PlanError, match="source and"):
        world.verify({Pool.KV: (np.array([0, 1]), np.array([2]))})


def test_copy_in_small_chunks_matches_one_big_copy(tp1, monkeypatch):
    world, plan, _ = tp1
    monkeypatch.setattr(runs, "CHUNK_NBYTES", 100)  # smaller than a page run of 128 bytes
    world.execute(plan)
    assert world.verify(REQUEST) == []


def _tp2_to_tp4_plan(kit, prefill, decode, src_pages, dst_pages):
    """NHD tp=2 -> tp=4 by hand: decode rank d holds heads [2d, 2d+2), which prefill
    rank d // 2 holds at local heads 2 * (d % 2) and up; per (page, token) one run of 2 heads."""
    d = decode.tp_rank
    batches = []
    for s_view, d_view in zip(prefill.views, decode.views, strict=True):
        s_page, s_token, s_head, _ = s_view.strides_nbytes
        d_page, d_token, _, _ = d_view.strides_nbytes
        pages, tokens = np.meshgrid(np.arange(len(src_pages)), np.arange(2), indexing="ij")
        src = (
            s_view.offset_nbytes
            + np.asarray(src_pages)[pages] * s_page
            + tokens * s_token
            + 2 * (d % 2) * s_head
        )
        dst = d_view.offset_nbytes + np.asarray(dst_pages)[pages] * d_page + tokens * d_token
        batches.append(kit.batch("kv", "kv", src, dst, 2 * 4 * BF16))
    return kit.Plan(prefill.rank_id, decode.rank_id, batches)


def test_heterogeneous_tp_hand_plan_is_byte_exact(kit):
    prefill = [kit.nhd_rank(Role.PREFILL, 2, r) for r in range(2)]
    decode = [kit.nhd_rank(Role.DECODE, 4, r, num_pages=9) for r in range(4)]
    world = World.build(prefill, decode, seed=5)
    src_pages, dst_pages = np.array([5, 0, 2]), np.array([8, 3, 0])
    for d in decode:
        world.execute(_tp2_to_tp4_plan(kit, prefill[d.tp_rank // 2], d, src_pages, dst_pages))
    world.assert_exact({Pool.KV: (src_pages, dst_pages)})


def test_heterogeneous_tp_with_the_wrong_prefill_rank_is_reported(kit):
    prefill = [kit.nhd_rank(Role.PREFILL, 2, r) for r in range(2)]
    decode = [kit.nhd_rank(Role.DECODE, 4, r) for r in range(4)]
    world = World.build(prefill, decode, seed=5)
    pages = np.array([1, 2])
    for d in decode:  # bug: every decode rank reads prefill rank 0
        world.execute(_tp2_to_tp4_plan(kit, prefill[0], d, pages, pages))
    lines = world.verify({Pool.KV: (pages, pages)})
    assert lines and all(line.startswith(("decode[pp0,tp2]", "decode[pp0,tp3]", "...")) for line in lines)


def _hnd_to_page_first_plan(kit, prefill, decode, src_pages, dst_pages, head_shift=0):
    """HND tp=1 -> page_first tp=2 by hand: one run of head_dim bytes per (page, head, token)."""
    start = 2 * decode.tp_rank + head_shift
    batches = []
    for d_view in decode.views:
        s_view = next(v for v in prefill.views if v.key == d_view.key)
        s_page, s_head, s_token, _ = s_view.strides_nbytes
        d_page, d_token, d_head, _ = d_view.strides_nbytes
        i, h, t = np.meshgrid(np.arange(len(src_pages)), np.arange(2), np.arange(2), indexing="ij")
        src = s_view.offset_nbytes + np.asarray(src_pages)[i] * s_page + (start + h) * s_head + t * s_token
        dst = d_view.offset_nbytes + np.asarray(dst_pages)[i] * d_page + h * d_head + t * d_token
        batches.append(kit.batch("kv", "host", src, dst, 4 * BF16))
    return kit.Plan(prefill.rank_id, decode.rank_id, batches)


def test_hnd_into_page_first_hand_plan_is_byte_exact(kit):
    prefill = kit.hnd_rank(Role.PREFILL, 1, 0)
    decode = [kit.page_first_rank(Role.DECODE, 2, r) for r in range(2)]
    world = World.build([prefill], decode, seed=6)
    src_pages, dst_pages = np.array([4, 1]), np.array([0, 6])
    for d in decode:
        world.execute(_hnd_to_page_first_plan(kit, prefill, d, src_pages, dst_pages))
    world.assert_exact({Pool.KV: (src_pages, dst_pages)})


def test_hnd_into_page_first_with_shifted_heads_is_reported(kit):
    prefill = kit.hnd_rank(Role.PREFILL, 1, 0)
    decode = [kit.page_first_rank(Role.DECODE, 2, 0)]
    world = World.build([prefill], decode, seed=6)
    pages = np.array([2])
    world.execute(_hnd_to_page_first_plan(kit, prefill, decode[0], pages, pages, head_shift=1))
    lines = world.verify({Pool.KV: (pages, pages)})
    assert len(lines) == 2  # k and v of layer 0
    assert "32/32 bytes differ, first at head=0 (global) token=0 dim=0 byte=0" in lines[0]


def test_verify_reports_a_requested_decode_tensor_no_prefill_rank_has(kit):
    src, dst = kit.nhd_rank(Role.PREFILL, 1, 0), kit.nhd_rank(Role.DECODE, 1, 0, layers=(0, 1, 2))
    world = World.build([src], [dst], seed=12)
    world.execute(kit.page_copy_plan(src, dst, SRC_PAGES, DST_PAGES))
    assert world.verify(REQUEST) == [
        "decode[pp0,tp0] kv.layer[2].k: requested, but no prefill rank registers this tensor, "
        "so nothing can fill it",
        "decode[pp0,tp0] kv.layer[2].v: requested, but no prefill rank registers this tensor, "
        "so nothing can fill it",
    ]
    # KV is not requested now, so every page the plan wrote is a stray write
    (stray,) = world.verify({Pool.AUX: (np.array([0]), np.array([0]))})
    assert "changed that the transfer must not touch" in stray
