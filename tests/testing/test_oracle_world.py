"""World.build: regions filled, prefill shards written where hand arithmetic says."""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.errors import GeometryError
from pd_transfer.layout.geometry import RankGeometry, Region, Role
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView
from pd_transfer.testing import World

BF16 = 2


def _tp2_tp4(kit, **kwargs):
    prefill = [kit.nhd_rank(Role.PREFILL, 2, r, **kwargs) for r in range(2)]
    decode = [kit.nhd_rank(Role.DECODE, 4, r, **kwargs) for r in range(4)]
    return prefill, decode


def test_build_writes_each_prefill_shard_at_hand_computed_offsets(kit):
    prefill, decode = _tp2_tp4(kit)
    world = World.build(prefill, decode, seed=1)
    logical = world.tensors[(Pool.KV, 1, "v")]
    assert logical.data.shape == (6, 2, 8, 4, BF16)  # page, token, head (global), dim, byte
    buf = world.prefill_buffers["prefill[pp0,tp1]"]["kv"]
    # layer 1 v is the 4th buffer: 3 * (6 pages * 2 tokens * 4 heads * 4 dims * 2 B + 64 pad)
    base = 3 * (6 * 2 * 4 * 4 * BF16 + kit.PAD_NBYTES)
    for page, token, head, dim in np.ndindex(6, 2, 4, 4):
        at = base + ((page * 2 + token) * 4 + head) * 4 * BF16 + dim * BF16
        assert bytes(buf[at : at + BF16]) == bytes(logical.data[page, token, 4 + head, dim])


def test_build_lays_out_the_same_truth_through_differently_ordered_axes(kit):
    prefill = [kit.hnd_rank(Role.PREFILL, 1, 0)]
    decode = [kit.page_first_rank(Role.DECODE, 2, r) for r in range(2)]
    world = World.build(prefill, decode, seed=2)
    logical = world.tensors[(Pool.KV, 0, "k")]
    assert logical.axis_names == ("page", "head", "token", "dim")
    buf = world.prefill_buffers["prefill[pp0,tp0]"]["kv"]
    for page, head, token, dim in np.ndindex(5, 4, 2, 4):
        at = ((page * 4 + head) * 2 + token) * 4 * BF16 + dim * BF16
        assert bytes(buf[at : at + BF16]) == bytes(logical.data[page, head, token, dim])


def test_build_writes_the_concatenation_of_grouped_shard_ranges():
    # conv state [q | k | v] with groups (4, 4, 8), prefill tp=2, rank 1 holds
    # q[2:4], k[2:4], v[4:8] = global channels 2,3, 6,7, 12..15
    axes = (Axis("slot", AxisRole.INDEX), Axis("channel", AxisRole.SHARD), Axis("width", AxisRole.INNER))

    def rank(role, tp_size, tp_rank):
        ranges = tuple((tp_rank * g // tp_size, (tp_rank + 1) * g // tp_size) for g in (4, 4, 8))
        view = TensorView(
            Pool.MAMBA,
            0,
            "conv",
            "state",
            0,
            "float32",
            (3, 16 // tp_size, 3),
            (16 // tp_size * 12, 12, 4),
            axes,
            ShardSpec.grouped((4, 4, 8), ranges),
            Layout.SLOT,
        )
        return RankGeometry(role, tp_size, tp_rank, 1, (view,), (Region("state", 3 * 16 * 12),))

    world = World.build([rank(Role.PREFILL, 2, r) for r in range(2)], [rank(Role.DECODE, 1, 0)], 3)
    logical = world.tensors[(Pool.MAMBA, 0, "conv")].data
    local = world.prefill_buffers["prefill[pp0,tp1]"]["state"][: 3 * 8 * 12].reshape(3, 8, 3, 4)
    assert np.array_equal(local, logical[:, [2, 3, 6, 7, 12, 13, 14, 15]])


def test_build_accepts_gqa_replicated_heads(kit):
    # 2 KV heads over decode tp=4: ranks 0,1 hold head 0, ranks 2,3 head 1
    prefill = [kit.nhd_rank(Role.PREFILL, 1, 0, num_heads=2)]
    decode = [kit.nhd_rank(Role.DECODE, 4, r, num_heads=2, heads=(r // 2, r // 2 + 1)) for r in range(4)]
    world = World.build(prefill, decode, seed=4)
    logical = world.tensors[(Pool.KV, 0, "k")]
    assert logical.data.shape == (6, 2, 2, 4, BF16)  # page, token, both heads, dim, byte
    buf = world.prefill_buffers["prefill[pp0,tp0]"]["kv"]
    assert bytes(buf[: logical.data.nbytes]) == logical.data.tobytes()  # tp 1 holds it whole


def test_build_refuses_a_shard_range_the_rank_should_not_hold(kit):
    prefill, decode = _tp2_tp4(kit)
    decode[1] = kit.nhd_rank(Role.DECODE, 4, 1, heads=(0, 2))
    with pytest.raises(
        GeometryError,
        match=r"decode\[pp0,tp1\].*\n.*holds \[0,2\) of group 8 but "
        r"tp_rank 1/4 should hold \[2,4\)",
    ):
        World.build(prefill, decode, seed=0)


def test_build_refuses_a_view_reaching_outside_its_region(kit):
    good = kit.nhd_rank(Role.DECODE, 1, 0)
    short = RankGeometry(Role.DECODE, 1, 0, 2, good.views, (Region("kv", good.regions[0].nbytes - 100),))
    with pytest.raises(GeometryError, match="reaches byte"):
        World.build([kit.nhd_rank(Role.PREFILL, 1, 0)], [short], seed=0)


def test_build_refuses_overlapping_views(kit):
    good = kit.nhd_rank(Role.PREFILL, 1, 0)
    k, v = good.views[0], good.views[1]
    clash = TensorView(
        v.pool,
        v.layer_id,
        v.name,
        v.region,
        k.offset_nbytes + 8,
        v.dtype,
        v.shape,
        v.strides_nbytes,
        v.axes,
        v.shard,
        v.layout,
    )
    bad = RankGeometry(Role.PREFILL, 1, 0, 2, (k, clash), good.regions)
    with pytest.raises(GeometryError, match="overlaps an earlier view"):
        World.build([bad], [kit.nhd_rank(Role.DECODE, 1, 0)], seed=0)


def test_build_refuses_axes_that_do_not_pair_by_name(kit):
    good = kit.nhd_rank(Role.DECODE, 1, 0)
    renamed = tuple(
        TensorView(
            v.pool,
            v.layer_id,
            v.name,
            v.region,
            v.offset_nbytes,
            v.dtype,
            v.shape,
            v.strides_nbytes,
            v.axes[:2] + (Axis("heads", AxisRole.SHARD),) + v.axes[3:],
            v.shard,
            v.layout,
        )
        for v in good.views
    )
    decode = RankGeometry(Role.DECODE, 1, 0, 2, renamed, good.regions)
    with pytest.raises(GeometryError, match="does not pair with its prefill tensor"):
        World.build([kit.nhd_rank(Role.PREFILL, 1, 0)], [decode], seed=0)


def test_build_refuses_a_rank_passed_on_the_wrong_side(kit):
    with pytest.raises(GeometryError, match="passed as a prefill rank"):
        World.build([kit.nhd_rank(Role.DECODE, 1, 0)], [], seed=0)


def test_build_is_deterministic_per_seed_and_starts_untouched(kit):
    prefill, decode = _tp2_tp4(kit)
    a, b = World.build(prefill, decode, seed=7), World.build(prefill, decode, seed=7)
    c = World.build(prefill, decode, seed=8)
    key = (Pool.KV, 0, "k")
    assert np.array_equal(a.tensors[key].data, b.tensors[key].data)
    assert not np.array_equal(a.tensors[key].data, c.tensors[key].data)
    assert np.array_equal(
        a.decode_buffers["decode[pp0,tp3]"]["kv"], b.decode_buffers["decode[pp0,tp3]"]["kv"]
    )
    assert a.verify({Pool.KV: (np.array([], int), np.array([], int))}) == []
