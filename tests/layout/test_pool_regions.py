"""Views stay inside their regions, never overlap, and fill them exactly.

The bytes of every view are marked in a numpy bool array per region through
``as_strided`` (tests/layout/view_bytes.py): a byte marked twice is an
overlap, a byte never marked means the region is larger than its views.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from view_bytes import mark_views

from pd_transfer.layout.geometry import Role
from pd_transfer.layout.pools import AttentionSpec, KvPoolShape, build_kv_pool
from pd_transfer.layout.presets import load_preset, preset_names
from pd_transfer.layout.rank_builder import WorkerShape, build_rank
from pd_transfer.layout.views import Layout

KV_LAYOUTS = [
    Layout.NHD,
    Layout.HND,
    Layout.LAYER_FIRST,
    Layout.PAGE_FIRST,
    Layout.PAGE_FIRST_DIRECT,
    Layout.PAGE_HEAD,
]
STATE_LAYOUTS = {
    Layout.NHD: Layout.SLOT,
    Layout.HND: Layout.SLOT,
    Layout.LAYER_FIRST: Layout.LAYER_FIRST,
    Layout.PAGE_FIRST: Layout.PAGE_FIRST,
    Layout.PAGE_FIRST_DIRECT: Layout.PAGE_FIRST_DIRECT,
    Layout.PAGE_HEAD: Layout.SLOT,
}


def _cases():
    for name in sorted(preset_names()):
        mla = load_preset(name).mla is not None
        for layout in KV_LAYOUTS:
            if mla and layout is Layout.PAGE_HEAD:
                continue  # refused for MLA, tested in test_kv_host_views
            yield pytest.param(name, layout, id=f"{name}-{layout.value}")


@pytest.mark.parametrize("name,layout", list(_cases()))
def test_views_are_inside_disjoint_and_fill_their_regions(name, layout):
    spec = load_preset(name)
    shape = WorkerShape(
        role=Role.PREFILL,
        tp_size=2,
        tp_rank=1,
        pp_size=2,
        pp_rank=1,
        page_size=2,
        kv_layout=layout,
        num_pages=2,
        num_swa_pages=3,
        num_slots=1,
        num_aux_rows=2,
        state_layout=STATE_LAYOUTS[layout],
    )
    geometry = build_rank(spec, shape)
    marks = mark_views({r.id: r.nbytes for r in geometry.regions}, geometry.views)
    unfilled = [rid for rid, m in marks.items() if not m.all()]
    assert unfilled == []


@settings(max_examples=60, deadline=None)
@given(
    num_kv_heads=st.sampled_from([1, 2, 4, 8]),
    tp_size=st.sampled_from([1, 2, 4]),
    head_dim=st.integers(1, 6),
    v_head_dim=st.integers(1, 6),
    num_pages=st.integers(1, 3),
    page_size=st.integers(1, 3),
    num_layers=st.integers(1, 3),
    layout=st.sampled_from(KV_LAYOUTS),
    dtype=st.sampled_from(["int8", "bfloat16", "float32"]),
)
def test_any_kv_pool_fills_its_regions_without_overlap(
    num_kv_heads, tp_size, head_dim, v_head_dim, num_pages, page_size, num_layers, layout, dtype
):
    attn = AttentionSpec(num_kv_heads, head_dim, v_head_dim)
    grid = KvPoolShape(num_pages, page_size, layout, dtype)
    for tp_rank in range(tp_size):
        pv = build_kv_pool(attn, range(10, 10 + num_layers), grid, tp_size=tp_size, tp_rank=tp_rank)
        marks = mark_views({r.id: r.nbytes for r in pv.regions}, pv.views)
        assert all(m.all() for m in marks.values())
