"""Hand-made geometries and hand-written plans for the oracle's own tests.

Everything here is written out by hand (strides, offsets, head ranges) so the
oracle is checked against arithmetic that shares no code with it. Exposed as
fixtures so the tests work under any pytest import mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from pd_transfer.layout.geometry import RankGeometry, Region, Role
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView

BF16 = 2
PAD_NBYTES = 64  # gap after every buffer, so stray writes into padding are visible

PAGE, TOKEN, HEAD, DIM = (
    Axis("page", AxisRole.INDEX),
    Axis("token", AxisRole.TOKEN),
    Axis("head", AxisRole.SHARD),
    Axis("dim", AxisRole.INNER),
)


@dataclass
class Batch:
    src_region: str
    dst_region: str
    src_offset: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray

    def byte_runs(self):
        return self.src_offset, self.dst_offset, self.nbytes


@dataclass
class Plan:
    src_rank: str
    dst_rank: str
    batches: list


def batch(src_region, dst_region, src, dst, nbytes) -> Batch:
    src, dst = np.asarray(src, np.int64).ravel(), np.asarray(dst, np.int64).ravel()
    return Batch(src_region, dst_region, src, dst, np.broadcast_to(np.int64(nbytes), src.shape).copy())


def head_range(num_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    per_rank = num_heads // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def nhd_rank(
    role: Role,
    tp_size: int,
    tp_rank: int,
    *,
    num_heads=8,
    head_dim=4,
    num_pages=6,
    page_size=2,
    layers=(0, 1),
    heads=None,
) -> RankGeometry:
    """Device NHD pool: per layer a K and a V buffer [page, token, head, dim], one region."""
    start, end = heads or head_range(num_heads, tp_size, tp_rank)
    local = end - start
    strides = (page_size * local * head_dim * BF16, local * head_dim * BF16, head_dim * BF16, BF16)
    buffer_nbytes = num_pages * strides[0]
    views, offset = [], 0
    for layer in layers:
        for name in ("k", "v"):
            views.append(
                TensorView(
                    Pool.KV,
                    layer,
                    name,
                    "kv",
                    offset,
                    "bfloat16",
                    (num_pages, page_size, local, head_dim),
                    strides,
                    (PAGE, TOKEN, HEAD, DIM),
                    ShardSpec.plain(num_heads, start, end),
                    Layout.NHD,
                )
            )
            offset += buffer_nbytes + PAD_NBYTES
    return RankGeometry(role, tp_size, tp_rank, page_size, tuple(views), (Region("kv", offset),))


def hnd_rank(
    role: Role, tp_size: int, tp_rank: int, *, num_heads=4, head_dim=4, num_pages=5, page_size=2, layers=(0,)
) -> RankGeometry:
    """Device HND pool: per layer a K and a V buffer [page, head, token, dim]."""
    start, end = head_range(num_heads, tp_size, tp_rank)
    local = end - start
    strides = (local * page_size * head_dim * BF16, page_size * head_dim * BF16, head_dim * BF16, BF16)
    views, offset = [], 0
    for layer in layers:
        for name in ("k", "v"):
            views.append(
                TensorView(
                    Pool.KV,
                    layer,
                    name,
                    "kv",
                    offset,
                    "bfloat16",
                    (num_pages, local, page_size, head_dim),
                    strides,
                    (PAGE, HEAD, TOKEN, DIM),
                    ShardSpec.plain(num_heads, start, end),
                    Layout.HND,
                )
            )
            offset += num_pages * strides[0] + PAD_NBYTES
    return RankGeometry(role, tp_size, tp_rank, page_size, tuple(views), (Region("kv", offset),))


def page_first_rank(
    role: Role, tp_size: int, tp_rank: int, *, num_heads=4, head_dim=4, num_pages=7, page_size=2, layers=(0,)
) -> RankGeometry:
    """Host page_first pool (2, S, L, H, D) in one region; a view per (layer, k/v)."""
    start, end = head_range(num_heads, tp_size, tp_rank)
    local, num_layers, num_slots = end - start, len(layers), num_pages * page_size
    slot_nbytes = num_layers * local * head_dim * BF16
    strides = (page_size * slot_nbytes, slot_nbytes, head_dim * BF16, BF16)
    views = []
    for kv, name in enumerate(("k", "v")):
        for position, layer in enumerate(layers):
            offset = kv * num_slots * slot_nbytes + position * local * head_dim * BF16
            views.append(
                TensorView(
                    Pool.KV,
                    layer,
                    name,
                    "host",
                    offset,
                    "bfloat16",
                    (num_pages, page_size, local, head_dim),
                    strides,
                    (PAGE, TOKEN, HEAD, DIM),
                    ShardSpec.plain(num_heads, start, end),
                    Layout.PAGE_FIRST,
                )
            )
    region = Region("host", 2 * num_slots * slot_nbytes)
    return RankGeometry(role, tp_size, tp_rank, page_size, tuple(views), (region,))


def page_copy_plan(src: RankGeometry, dst: RankGeometry, src_pages, dst_pages) -> Plan:
    """TP1 -> TP1, identical NHD layout: each page of each buffer is one contiguous run."""
    batches = []
    for s_view in src.views:
        d_view = dst.view(s_view.key)
        page_nbytes = s_view.strides_nbytes[0]
        batches.append(
            batch(
                s_view.region,
                d_view.region,
                s_view.offset_nbytes + np.asarray(src_pages) * page_nbytes,
                d_view.offset_nbytes + np.asarray(dst_pages) * page_nbytes,
                page_nbytes,
            )
        )
    return Plan(src.rank_id, dst.rank_id, batches)


@pytest.fixture
def kit():
    return SimpleNamespace(
        Batch=Batch,
        Plan=Plan,
        batch=batch,
        nhd_rank=nhd_rank,
        hnd_rank=hnd_rank,
        page_first_rank=page_first_rank,
        page_copy_plan=page_copy_plan,
        head_range=head_range,
        BF16=BF16,
        PAD_NBYTES=PAD_NBYTES,
    )
