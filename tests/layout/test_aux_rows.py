"""Aux metadata rows: one region, one [rows, elems] block per field."""

from __future__ import annotations

import pytest
import torch
from view_bytes import mark_views, torch_layout, view_layout

from pd_transfer.errors import ConfigError
from pd_transfer.layout.pools import AuxField, build_aux_rows
from pd_transfer.layout.views import Pool


def test_aux_rows_hold_output_ids_and_bootstrap_room():
    pv = build_aux_rows(6)
    views = {v.name: v for v in pv.views}
    assert views["output_ids"].dtype == "int32" and views["output_ids"].shape == (6, 16)
    assert views["bootstrap_room"].dtype == "int64" and views["bootstrap_room"].shape == (6, 8)
    for view in pv.views:
        assert view.pool is Pool.AUX and view.layer_id is None and view.shard is None
        assert [a.name for a in view.axes] == ["row", "elem"]
        assert view.region == "aux"
        rows = torch.empty((6, view.shape[1]), dtype=getattr(torch, view.dtype))
        assert view_layout(view)[1:] == torch_layout(rows)[1:]


def test_aux_blocks_start_aligned_and_fill_the_region_exactly():
    pv = build_aux_rows(3, (AuxField("a", "int8", 5), AuxField("b", "int64", 2)))
    a, b = pv.views
    assert b.offset_nbytes % 64 == 0 and b.offset_nbytes >= 15
    (region,) = pv.regions
    assert region.nbytes == b.offset_nbytes + 3 * 16
    mark_views({region.id: region.nbytes}, pv.views)


def test_aux_refuses_zero_rows():
    with pytest.raises(ConfigError, match="num_aux_rows"):
        build_aux_rows(0)
