"""Different page sizes on each side: token-paged pools convert, byte-exact, in every layout.

The acceptance matrix: page sizes {1, 16, 64} x {1, 16, 64} across the KV
layouts, for GQA, MLA and SWA beside full attention, planned and checked
against the oracle (which maps tokens on its own), once through the oracle's
copy and once through the copy engine. Rejects only where no token mapping
exists, naming both values, the reason code and the fix.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from transfer_check import instance, random_requests, transfer_and_verify

from pd_transfer.errors import PlanError, Reason
from pd_transfer.layout.geometry import RankGeometry, Region, Role
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.layout.planner import PairPlanner, plan_pair
from pd_transfer.layout.reconcile import Mode, reconcile
from pd_transfer.layout.spans import TokenSpan, request_lengths_agree
from pd_transfer.layout.views import KV_LAYOUTS, Axis, AxisRole, Layout, Pool, TensorView
from pd_transfer.testing import World
from pd_transfer.transport.copy.copy_engine import CopyEngine

PAGE_SIZES = (1, 16, 64)
PAGE_PAIRS = [p for p in itertools.product(PAGE_SIZES, PAGE_SIZES) if p[0] != p[1]]
ALL_PAGE_PAIRS = list(itertools.product(PAGE_SIZES, PAGE_SIZES))
MLA_LAYOUTS = (Layout.NHD, Layout.HND, Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)
TOKENS = 384  # tokens each pool holds on each side, whatever its page size


def _side(kind: str, role: Role, tp: int, page_size: int, layout: Layout, **extra):
    pages = TOKENS // page_size
    if kind == "swa":
        extra.setdefault("num_swa_pages", pages)
    return instance(kind, role, tp, layout=layout, page_size=page_size, num_pages=pages, **extra)


def _pair_id(value) -> str:
    return value.value if isinstance(value, Layout) else str(value)


def _plans(recon, prefill, decode, requests):
    by_id = {g.rank_id: g for g in prefill}
    return [
        plan_pair(recon, by_id[src_id], dst, requests) for dst in decode for src_id in recon.sources_for(dst)
    ]


@pytest.mark.parametrize("page_sizes", ALL_PAGE_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize(
    "src_layout,dst_layout", list(itertools.product(KV_LAYOUTS, KV_LAYOUTS)), ids=_pair_id
)
def test_gqa_page_size_pairs_move_byte_exact_in_every_layout_pair(page_sizes, src_layout, dst_layout):
    prefill = _side("gqa", Role.PREFILL, 1, page_sizes[0], src_layout)
    decode = _side("gqa", Role.DECODE, 1, page_sizes[1], dst_layout)
    recon = reconcile(prefill, decode)
    assert recon.ok, str(recon.error())
    kv = [v for v in recon.verdicts if v.key[0] is Pool.KV]
    if page_sizes[0] != page_sizes[1]:
        assert {v.mode for v in kv} == {Mode.CONVERTED}
        assert {v.page_sizes for v in kv} == {page_sizes}
    assert transfer_and_verify(prefill, decode, seed=page_sizes[0] + 7 * page_sizes[1]) == []


@pytest.mark.parametrize("page_sizes", PAGE_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("tp_src,tp_dst", [(2, 4), (4, 1), (1, 8)])
def test_page_size_conversion_combines_with_tp_slicing(page_sizes, tp_src, tp_dst):
    layouts = KV_LAYOUTS[(tp_src + page_sizes[1]) % len(KV_LAYOUTS)], Layout.HND
    prefill = _side("gqa", Role.PREFILL, tp_src, page_sizes[0], layouts[0])
    decode = _side("gqa", Role.DECODE, tp_dst, page_sizes[1], layouts[1])
    verdicts = reconcile(prefill, decode).verdicts
    assert {v.page_sizes for v in verdicts if v.key[0] is Pool.KV} == {page_sizes}
    assert transfer_and_verify(prefill, decode, seed=tp_src * tp_dst) == []


@pytest.mark.parametrize("page_sizes", PAGE_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("dst_layout", MLA_LAYOUTS, ids=_pair_id)
@pytest.mark.parametrize("tp_src,tp_dst", [(1, 1), (2, 4)])
def test_mla_latents_convert_page_sizes_with_one_writer(page_sizes, dst_layout, tp_src, tp_dst):
    prefill = _side("mla", Role.PREFILL, tp_src, page_sizes[0], Layout.PAGE_FIRST_DIRECT)
    decode = _side("mla", Role.DECODE, tp_dst, page_sizes[1], dst_layout)
    recon = reconcile(prefill, decode)
    for dst in decode:
        assert len(recon.sources_for(dst)) == 1
    assert transfer_and_verify(prefill, decode, seed=page_sizes[1]) == []


@pytest.mark.parametrize("page_sizes", PAGE_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("dst_layout", KV_LAYOUTS, ids=_pair_id)
def test_swa_window_pages_convert_aligned_at_the_request_end(page_sizes, dst_layout):
    prefill = _side("swa", Role.PREFILL, 2, page_sizes[0], Layout.NHD)
    decode = _side("swa", Role.DECODE, 1, page_sizes[1], dst_layout)
    assert {v.page_sizes for v in reconcile(prefill, decode).verdicts if v.key[0] is Pool.SWA} == {page_sizes}
    for seed in range(3):
        assert transfer_and_verify(prefill, decode, seed=seed) == []


@pytest.mark.parametrize("page_sizes", [(16, 64), (64, 1)], ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_state_slots_and_aux_rows_are_unaffected_by_page_sizes(kind, page_sizes):
    prefill = _side(kind, Role.PREFILL, 2, page_sizes[0], Layout.NHD)
    decode = _side(kind, Role.DECODE, 4, page_sizes[1], Layout.PAGE_FIRST)
    recon = reconcile(prefill, decode)
    assert all(v.page_sizes is None for v in recon.verdicts if v.key[0] in (Pool.MAMBA, Pool.AUX))
    assert transfer_and_verify(prefill, decode, seed=5) == []


@pytest.mark.parametrize("page_sizes", ALL_PAGE_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize(
    "layouts",
    [
        (Layout.NHD, Layout.PAGE_HEAD),
        (Layout.LAYER_FIRST, Layout.HND),
        (Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT),
    ],
    ids=lambda p: f"{p[0].value}-{p[1].value}",
)
def test_copy_engine_moves_converted_plans_byte_exact(page_sizes, layouts):
    prefill = _side("gqa", Role.PREFILL, 2, page_sizes[0], layouts[0])
    decode = _side("gqa", Role.DECODE, 4, page_sizes[1], layouts[1])
    recon = reconcile(prefill, decode)
    requests = random_requests(prefill, decode, np.random.default_rng(11))
    world = World.build(prefill, decode, 11)
    engine = CopyEngine(direct_max_runs=0, num_workers=1, native=None)
    try:
        plans = _plans(recon, prefill, decode, requests)
        for plan in plans:
            engine.execute(plan, world.prefill_buffers[plan.src_rank], world.decode_buffers[plan.dst_rank])
    finally:
        engine.close()
    assert world.verify(requests) == []


# -- what the plans look like -----------------------------------------------------


def _gqa_pair(page_sizes, layouts=(Layout.NHD, Layout.NHD)):
    prefill = _side("gqa", Role.PREFILL, 1, page_sizes[0], layouts[0])
    decode = _side("gqa", Role.DECODE, 1, page_sizes[1], layouts[1])
    return PairPlanner(reconcile(prefill, decode), prefill[0], decode[0])


def test_a_prefill_page_of_16_lands_as_one_run_in_a_decode_page_of_64():
    planner = _gqa_pair((16, 64))
    plan = planner.plan({Pool.KV: (np.array([7, 2, 9]), np.array([5]))})
    token_nbytes = 8 * 4 * 2  # 8 heads x head_dim 4 x bfloat16
    for batch in plan.batches:  # one batch per tensor: K and V of 3 layers
        assert batch.nbytes.tolist() == [16 * token_nbytes] * 3
        assert batch.count.tolist() == [1, 1, 1]
        assert batch.src_offset.tolist() == [p * 16 * token_nbytes for p in (7, 2, 9)]
        assert batch.dst_offset.tolist() == [5 * 64 * token_nbytes + k * 16 * token_nbytes for k in range(3)]


def test_consecutive_prefill_pages_coalesce_into_one_run_across_their_boundary():
    planner = _gqa_pair((16, 64))
    plan = planner.plan({Pool.KV: (np.array([4, 5, 6, 7]), np.array([1]))})
    assert all(b.nbytes.tolist() == [64 * 64] for b in plan.batches)


def test_hnd_conversion_copies_one_run_per_head_per_prefill_page():
    planner = _gqa_pair((16, 64), (Layout.HND, Layout.HND))
    plan = planner.plan({Pool.KV: (np.array([3, 8]), np.array([0]))})
    for batch in plan.batches:
        # per prefill page one descriptor of 8 heads, each 16 tokens x head_dim 4 x 2 bytes
        assert batch.nbytes.tolist() == [16 * 4 * 2] * 2 and batch.count.tolist() == [8, 8]
        assert (batch.src_stride, batch.dst_stride) == (16 * 4 * 2, 64 * 4 * 2)


def test_a_partial_last_page_is_owed_only_up_to_the_shorter_side():
    planner = _gqa_pair((64, 16))
    # 40 tokens: one prefill page of 64, three decode pages of 16 (48 slots)
    plan = planner.plan({Pool.KV: (np.array([2]), np.array([9, 0, 4]))})
    assert plan.total_nbytes == 6 * 48 * 64


def test_page_counts_no_token_count_fills_are_refused_not_truncated():
    planner = _gqa_pair((16, 64))
    assert not request_lengths_agree(3, 2, 16, 64)
    with pytest.raises(PlanError) as err:
        planner.plan({Pool.KV: (np.array([0, 1, 2]), np.array([0, 1]))})
    assert err.value.code is Reason.INDEX_COUNT_MISMATCH
    assert "3 page(s) of 16 tokens" in str(err.value) and "2 page(s) of 64 tokens" in str(err.value)


def test_a_span_that_starts_off_a_page_boundary_is_refused():
    planner = _gqa_pair((16, 64))
    with pytest.raises(PlanError) as err:
        planner.plan({Pool.KV: TokenSpan(np.array([0]), np.array([1]), 8, 0)})
    assert err.value.code is Reason.INDEX_NOT_PAGE_ALIGNED


def test_a_chunked_room_lands_each_chunk_at_its_tokens():
    prefill = _side("gqa", Role.PREFILL, 1, 16, Layout.NHD)
    decode = _side("gqa", Role.DECODE, 1, 64, Layout.PAGE_FIRST)
    recon = reconcile(prefill, decode)
    planner = PairPlanner(recon, prefill[0], decode[0])
    src, dst = np.array([9, 3, 0, 5, 7]), np.array([2, 1])
    world = World.build(prefill, decode, 3)
    for start, stop in ((0, 3), (3, 5)):  # 48 tokens, then 32 more
        world.execute(planner.plan({Pool.KV: TokenSpan(src[start:stop], dst, 16 * start, 0)}))
    assert world.verify({Pool.KV: (src, dst)}) == []


def test_the_oracle_catches_a_conversion_that_drops_one_granule():
    planner = _gqa_pair((16, 64))
    requests = {Pool.KV: (np.array([7, 2, 9]), np.array([5]))}
    prefill, decode = planner.src, planner.dst
    plan = planner.plan(requests)
    first = plan.batches[0]
    short = RunBatch(
        first.src_region,
        first.dst_region,
        first.src_offset[:-1],
        first.dst_offset[:-1],
        first.nbytes[:-1],
        first.count[:-1],
        first.src_stride,
        first.dst_stride,
    )
    world = World.build([prefill], [decode], 0)
    world.execute(TransferPlan(plan.src_rank, plan.dst_rank, (short,) + plan.batches[1:]))
    lines = world.verify(requests)
    assert lines and "kv.layer[0].k token page dst=5 slot=32 src=9 slot=0" in lines[0]


# -- rejects: exactly where no token mapping exists ------------------------------


def _opaque_rank(role: Role, page_size: int, token_axis: bool, inner_stride: int = 2):
    """One hand-registered KV tensor: with a token axis, or pages as opaque bytes."""
    if token_axis:
        shape, axes = (
            (4, page_size, 8),
            (Axis("page", AxisRole.INDEX), Axis("token", AxisRole.TOKEN), Axis("head_dim", AxisRole.INNER)),
        )
        strides = (page_size * 8 * inner_stride, 8 * inner_stride, inner_stride)
        nbytes = 4 * page_size * 8 * inner_stride
    else:
        shape, axes = (4, 64), (Axis("page", AxisRole.INDEX), Axis("bytes", AxisRole.INNER))
        strides, nbytes = (64, 1), 256
    view = TensorView(
        Pool.KV,
        0,
        "k",
        "kv",
        0,
        "bfloat16" if token_axis else "uint8",
        shape,
        strides,
        axes,
        None,
        Layout.NHD,
    )
    return RankGeometry(role, 1, 0, page_size, (view,), (Region("kv", nbytes),))


def test_pages_registered_as_opaque_bytes_cannot_convert_and_say_how_to_fix_it():
    recon = reconcile(_opaque_rank(Role.PREFILL, 16, False), _opaque_rank(Role.DECODE, 64, False))
    (mismatch,) = recon.mismatches
    assert mismatch.code is Reason.PAGE_SIZE_MISMATCH and mismatch.path == "kv.layer[0].k.page_size"
    assert mismatch.prefill == "16 tokens/page, no token axis"
    assert mismatch.decode == "64 tokens/page, no token axis"
    assert "register its token axis" in mismatch.hint


def test_a_strided_inner_axis_would_cut_pieces_below_the_minimum_and_is_refused():
    recon = reconcile(
        _opaque_rank(Role.PREFILL, 16, True), _opaque_rank(Role.DECODE, 64, True, inner_stride=4)
    )
    (mismatch,) = recon.mismatches
    assert mismatch.code is Reason.PAGE_SIZE_MISMATCH
    assert (mismatch.prefill, mismatch.decode) == (
        "16 tokens/page, pieces of 16 B",
        "64 tokens/page, pieces of 2 B",
    )
    assert "one inner row" in mismatch.hint and "same --page-size" in mismatch.hint
    # the same strides with equal page sizes are no conversion, and are accepted
    assert reconcile(
        _opaque_rank(Role.PREFILL, 16, True), _opaque_rank(Role.DECODE, 16, True, inner_stride=4)
    ).ok


def test_the_same_hand_registered_tensor_converts_when_its_rows_are_contiguous():
    recon = reconcile(_opaque_rank(Role.PREFILL, 16, True), _opaque_rank(Role.DECODE, 64, True))
    assert recon.ok and recon.verdicts[0].mode is Mode.CONVERTED
