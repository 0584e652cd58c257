"""A registration is checked on its own before anything is reconciled."""

import dataclasses

import pytest
from transfer_check import instance

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.layout.geometry import Region, Role, check_geometry
from pd_transfer.layout.views import ShardSpec


def _rank():
    return instance("gqa", Role.DECODE, 2)[1]


def test_view_reaching_outside_its_region_is_refused():
    rank = _rank()
    view = rank.views[0]
    shrunk = tuple(Region(r.id, r.nbytes - 1) if r.id == view.region else r for r in rank.regions)
    with pytest.raises(GeometryError) as err:
        check_geometry(dataclasses.replace(rank, regions=shrunk))
    assert err.value.code is Reason.VIEW_OUT_OF_REGION
    assert view.path in str(err.value)


def test_duplicate_tensor_and_unknown_region_are_all_listed():
    rank = _rank()
    stray = dataclasses.replace(rank.views[1], region="nowhere")
    with pytest.raises(GeometryError) as err:
        check_geometry(dataclasses.replace(rank, views=rank.views + (rank.views[0], stray)))
    text = str(err.value)
    assert "registered twice" in text and "unknown region 'nowhere'" in text


def test_shard_range_must_be_the_ranks_canonical_range():
    rank = _rank()  # tp_rank 1 of 2 holds heads [4, 8)
    wrong = dataclasses.replace(rank.views[0], shard=ShardSpec.plain(8, 0, 4))
    with pytest.raises(GeometryError) as err:
        check_geometry(dataclasses.replace(rank, views=(wrong,) + rank.views[1:]))
    assert err.value.code is Reason.SHARD_RANGE_INVALID
    assert "should hold [4,8)" in str(err.value)


def test_view_with_mismatched_shard_extent_cannot_be_constructed():
    view = _rank().views[0]
    with pytest.raises(GeometryError, match="shard axis holds 4"):
        dataclasses.replace(view, shard=ShardSpec.plain(8, 0, 2))
