"""The layout order table gives SGLang's documented host strides."""

from __future__ import annotations

import pytest

from pd_transfer.layout.pools.memory_order import KV_ORDER, element_strides
from pd_transfer.layout.views import Layout

P, PS, L, H, D = 7, 16, 5, 4, 128
SIZES = {"page": P, "token": PS, "layer": L, "head": H, "dim": D}


@pytest.mark.parametrize(
    "layout,expected",
    [
        # (layer offset per position, page, token, head, dim) in elements, from the design table
        (Layout.LAYER_FIRST, (P * PS * H * D, PS * H * D, H * D, D, 1)),
        (Layout.PAGE_FIRST, (H * D, PS * L * H * D, L * H * D, D, 1)),
        (Layout.PAGE_FIRST_DIRECT, (PS * H * D, L * PS * H * D, H * D, D, 1)),
        (Layout.PAGE_HEAD, (D, H * PS * L * D, L * D, PS * L * D, 1)),
    ],
)
def test_host_layout_strides_match_design_table(layout, expected):
    strides = element_strides(KV_ORDER[layout], SIZES)
    got = tuple(strides[n] for n in ("layer", "page", "token", "head", "dim"))
    assert got == expected


def test_device_layouts_have_no_layer_axis():
    assert "layer" not in KV_ORDER[Layout.NHD] and "layer" not in KV_ORDER[Layout.HND]
