"""Golden text of the main reconciliation and planning diagnostics.

These messages are what an operator reads when a pair is refused, so their
exact text is pinned here: both sides' values, the stable reason code, the
hint. Changing one is a deliberate act: update the golden text with it.

Models are tiny inline tables (4 KV heads of 8, a 2-layer GDN hybrid) so every
case builds in milliseconds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pd_transfer.errors import PlanError, Reason, ReconcileError
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.planner import plan_pair
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec

SHAPE = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_slots": 2, "num_aux_rows": 2}


def _gqa(num_kv_heads: int = 4, num_layers: int = 2):
    return model_from_table(
        {
            "name": "tiny-gqa",
            "num_layers": num_layers,
            "layer_cycle": ["attention"],
            "attention": {"num_kv_heads": num_kv_heads, "head_dim": 8},
        },
        "inline",
    )


# layer 0 GDN (conv groups q|k|v = 8|8|16 channels, 4 value heads), layer 1 attention
TINY_GDN = model_from_table(
    {
        "name": "tiny-gdn",
        "num_layers": 2,
        "layer_cycle": ["gdn", "attention"],
        "attention": {"num_kv_heads": 2, "head_dim": 8},
        "gdn": {
            "num_key_heads": 2,
            "key_head_dim": 4,
            "num_value_heads": 4,
            "value_head_dim": 4,
            "conv_kernel": 4,
        },
    },
    "inline",
)


def _instance(spec, role: Role, tp_size: int, pp_size: int = 1, **shape) -> list[RankGeometry]:
    return build_instance(spec, role, tp_size, pp_size, **{**SHAPE, **shape})


def _edit_views(ranks: list[RankGeometry], edit) -> list[RankGeometry]:
    """Each rank with ``edit(rank, view)`` applied to every view."""
    return [dataclasses.replace(g, views=tuple(edit(g, v) for v in g.views)) for g in ranks]


def _rejection(prefill, decode) -> ReconcileError:
    recon = reconcile(prefill, decode)
    assert not recon.ok
    return recon.error()


def _codes(err: ReconcileError) -> list[Reason]:
    return [m.code for m in err.mismatches]


def test_dtype_mismatch_names_both_dtypes_once_per_tensor_over_all_layers():
    err = _rejection(
        _instance(_gqa(), Role.PREFILL, 1), _instance(_gqa(), Role.DECODE, 2, kv_dtype="float8_e4m3fn")
    )
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=1) with decode (attn_tp=2): 2 mismatches
  - kv.layer[0-1].k.dtype: prefill=bfloat16 decode=float8_e4m3fn  [dtype_mismatch]
  - kv.layer[0-1].v.dtype: prefill=bfloat16 decode=float8_e4m3fn  [dtype_mismatch]
  hint: configure the same KV/state dtype on prefill and decode"""
    )
    assert _codes(err) == [Reason.DTYPE_MISMATCH] * 2
    assert err.code is Reason.DTYPE_MISMATCH


def _opaque_pages(ranks: list[RankGeometry]) -> list[RankGeometry]:
    """KV pages registered as opaque bytes (no token axis), as a raw-pointer adapter might."""

    def edit(rank, view):
        if view.pool is not Pool.KV:
            return view
        return dataclasses.replace(
            view,
            dtype="uint8",
            shape=(view.index_count, view.item_nbytes),
            strides_nbytes=(view.strides_nbytes[0], 1),
            shard=None,
            axes=(Axis("page", AxisRole.INDEX), Axis("page_bytes", AxisRole.INNER)),
        )

    return _edit_views(ranks, edit)


def test_page_sizes_differ_on_opaque_pages_names_both_page_sizes_and_the_fix():
    err = _rejection(
        _opaque_pages(_instance(_gqa(), Role.PREFILL, 1)),
        _opaque_pages(_instance(_gqa(), Role.DECODE, 1, page_size=8)),
    )
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=1) with decode (attn_tp=1): 2 mismatches
  - kv.layer[0-1].k.page_size: prefill=4 tokens/page, no token axis decode=8 tokens/page, \
no token axis  [page_size_mismatch]
  - kv.layer[0-1].v.page_size: prefill=4 tokens/page, no token axis decode=8 tokens/page, \
no token axis  [page_size_mismatch]
  hint: the tensor's pages are registered as opaque bytes, so a page cannot be cut into \
tokens: register its token axis (page, token, head, head_dim), or run prefill and decode with \
the same --page-size"""
    )
    assert _codes(err) == [Reason.PAGE_SIZE_MISMATCH] * 2


def test_global_head_count_mismatch_is_never_inferred_from_byte_lengths():
    # 4 KV heads over tp 2 and 8 over tp 4 hold the same bytes per rank (2 heads each)
    err = _rejection(
        _instance(_gqa(num_kv_heads=4), Role.PREFILL, 2), _instance(_gqa(num_kv_heads=8), Role.DECODE, 4)
    )
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=2) with decode (attn_tp=4): 2 mismatches
  - kv.layer[0-1].k.head.global_extent: prefill=4 decode=8  [global_extent_mismatch]
  - kv.layer[0-1].v.head.global_extent: prefill=4 decode=8  [global_extent_mismatch]
  hint: both sides must serve the same model (same global head/channel count), each registering \
the model's count, not one padded or replicated for its TP size"""
    )
    assert _codes(err) == [Reason.GLOBAL_EXTENT_MISMATCH] * 2


def test_gdn_conv_without_shard_groups_on_one_side_is_refused():
    def plain_conv(rank: RankGeometry, view):
        if view.pool is not Pool.MAMBA or view.name != "conv":
            return view
        # the same local extent registered as one plain channel range, groups undeclared:
        # decode tp 2 rank 0 really holds q[0,4) | k[0,4) | v[0,8), not channels [0,16)
        start = rank.tp_rank * view.shard.local_extent
        return dataclasses.replace(
            view, shard=ShardSpec.plain(view.shard.global_extent, start, start + view.shard.local_extent)
        )

    err = _rejection(
        _instance(TINY_GDN, Role.PREFILL, 1), _edit_views(_instance(TINY_GDN, Role.DECODE, 2), plain_conv)
    )
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=1) with decode (attn_tp=2): 1 mismatch
  - mamba.layer[0].conv.channel.shard_groups: prefill=[8,8,16] decode=<missing>  [shard_groups_missing]
  hint: 'channel' is a concatenation of independently sharded groups: both sides must register \
the same shard groups, or slicing would mix channels of different groups"""
    )
    assert _codes(err) == [Reason.SHARD_GROUPS_MISSING]


def test_mamba_state_without_dim_metadata_is_not_copied_whole_when_item_sizes_differ():
    # SGLang seed 003: decode registers its Mamba state without per-tensor dim metadata
    # at a different attention TP; a whole-item copy would corrupt, so it is refused
    def drop_state_shard(rank: RankGeometry, view):
        return dataclasses.replace(view, shard=None) if view.pool is Pool.MAMBA else view

    err = _rejection(
        _instance(TINY_GDN, Role.PREFILL, 1),
        _edit_views(_instance(TINY_GDN, Role.DECODE, 2), drop_state_shard),
    )
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=1) with decode (attn_tp=2): 2 mismatches
  - mamba.layer[0].conv.shard: prefill=item 192 B, 'channel' groups {[0,8) of 8, [0,8) of 8, \
[0,16) of 16} decode=item 96 B, <missing: global extent and local range of sharded axis \
'channel'>  [shard_metadata_missing]
  - mamba.layer[0].temporal.shard: prefill=item 256 B, 'head' [0,4) of 4 decode=item 128 B, \
<missing: global extent and local range of sharded axis 'head'>  [shard_metadata_missing]
  hint: item sizes differ (192 B vs 96 B) and attention TP differs (1 vs 2), so 'channel' must \
be resliced, which needs per-tensor dim metadata on both sides: register the global extent and \
the local [start, end) of the sharded axis, or run both sides with equal attention TP
  hint: item sizes differ (256 B vs 128 B) and attention TP differs (1 vs 2), so 'head' must \
be resliced, which needs per-tensor dim metadata on both sides: register the global extent and \
the local [start, end) of the sharded axis, or run both sides with equal attention TP"""
    )
    assert _codes(err) == [Reason.SHARD_METADATA_MISSING] * 2


def test_layers_of_an_unregistered_decode_pp_stage_are_listed_as_missing():
    # decode pp 2 over 4 layers: stage 1 (layers 2-3) never registered
    decode_stage0 = _instance(_gqa(num_layers=4), Role.DECODE, 1, pp_size=2)[:1]
    err = _rejection(_instance(_gqa(num_layers=4), Role.PREFILL, 1), decode_stage0)
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=1) with decode (attn_tp=1): 2 mismatches
  - kv.layer[2-3].k: prefill=registered (nhd) decode=<missing>  [layer_missing]
  - kv.layer[2-3].v: prefill=registered (nhd) decode=<missing>  [layer_missing]
  hint: pair instances of the same model; with pipeline parallelism every layer id must be \
registered by exactly one stage on each side"""
    )
    assert _codes(err) == [Reason.LAYER_MISSING] * 2


def test_layers_decode_holds_but_no_prefill_rank_registered_are_listed_as_missing():
    prefill_stage0 = _instance(_gqa(num_layers=4), Role.PREFILL, 2, pp_size=2)[:2]
    err = _rejection(prefill_stage0, _instance(_gqa(num_layers=4), Role.DECODE, 1))
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=2) with decode (attn_tp=1): 2 mismatches
  - kv.layer[2-3].k: prefill=<missing> decode=registered (nhd)  [layer_missing]
  - kv.layer[2-3].v: prefill=<missing> decode=registered (nhd)  [layer_missing]
  hint: pair instances of the same model; with pipeline parallelism every layer id must be \
registered by exactly one stage on each side"""
    )
    assert _codes(err) == [Reason.LAYER_MISSING] * 2


def test_sharded_axis_that_does_not_split_over_a_sides_tp_is_refused():
    # 6 KV heads: prefill tp 2 holds 3 each; a decode at tp 4 claims 2 heads per rank
    # (ranks 2 and 3 both [4,6)), which no canonical split gives
    def six_heads(rank: RankGeometry, view):
        if view.pool is not Pool.KV:
            return view
        start = min(2 * rank.tp_rank, 4)
        return dataclasses.replace(view, shard=ShardSpec.plain(6, start, start + 2))

    decode = _edit_views(_instance(_gqa(num_kv_heads=8), Role.DECODE, 4), six_heads)
    err = _rejection(_instance(_gqa(num_kv_heads=6), Role.PREFILL, 2), decode)
    assert (
        str(err)
        == """\
cannot reconcile prefill (attn_tp=2) with decode (attn_tp=4): 4 mismatches
  - kv.layer[0-1].k: prefill=- decode=sharded axis group of 6 does not split over attn_tp 4 \
(decode[pp0,tp0-3])  [shard_not_divisible]
  - kv.layer[0-1].v: prefill=- decode=sharded axis group of 6 does not split over attn_tp 4 \
(decode[pp0,tp0-3])  [shard_not_divisible]
  - kv.layer[0-1].k.head: prefill=6 over attn_tp 2 decode=6 over attn_tp 4 (does not split)  \
[shard_not_divisible]
  - kv.layer[0-1].v.head: prefill=6 over attn_tp 2 decode=6 over attn_tp 4 (does not split)  \
[shard_not_divisible]
  hint: fix the worker's registration
  hint: choose attention TP sizes that divide 6 (or that 6 divides)"""
    )
    assert _codes(err) == [Reason.SHARD_NOT_DIVISIBLE] * 4


# -- planning ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gdn_pair():
    prefill = _instance(TINY_GDN, Role.PREFILL, 1)
    decode = _instance(TINY_GDN, Role.DECODE, 2)
    recon = reconcile(prefill, decode)
    assert recon.ok
    return recon, prefill[0], decode[0]


def test_unequal_state_slot_counts_are_refused_not_truncated(gdn_pair):
    recon, src, dst = gdn_pair
    with pytest.raises(PlanError) as info:
        plan_pair(recon, src, dst, {Pool.MAMBA: (np.array([0]), np.array([0, 1]))})
    assert (
        str(info.value)
        == """\
mamba: prefill sends 1 slot(s) but decode expects 2; the request is refused rather than truncated
  hint: allocate as many destination slots as the source sends"""
    )
    assert info.value.code is Reason.INDEX_COUNT_MISMATCH


def test_page_index_outside_the_decode_pool_is_refused(gdn_pair):
    recon, src, dst = gdn_pair
    with pytest.raises(PlanError) as info:
        plan_pair(recon, src, dst, {Pool.KV: (np.array([0, 1]), np.array([3, 8]))})
    assert (
        str(info.value)
        == """\
kv: decode page index 8 is outside decode[pp0,tp0]'s pool of 8 pages
  hint: page indices must be in [0, 8)"""
    )
    assert info.value.code is Reason.INDEX_OUT_OF_RANGE


def test_negative_slot_index_on_the_prefill_side_is_refused(gdn_pair):
    recon, src, dst = gdn_pair
    with pytest.raises(PlanError) as info:
        plan_pair(recon, src, dst, {Pool.MAMBA: (np.array([-1]), np.array([1]))})
    assert (
        str(info.value)
        == """\
mamba: prefill slot index -1 is outside prefill[pp0,tp0]'s pool of 2 slots
  hint: slot indices must be in [0, 2)"""
    )
    assert info.value.code is Reason.INDEX_OUT_OF_RANGE
