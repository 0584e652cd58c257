"""The oracle's own shard arithmetic, checked against hand-computed tables."""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.errors import GeometryError
from pd_transfer.layout.views import ShardSpec
from pd_transfer.testing import expected_range, shard_positions


def test_expected_range_splits_a_large_group_evenly():
    assert [expected_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert expected_range(8, 2, 1) == (4, 8)
    assert expected_range(8, 1, 0) == (0, 8)


def test_expected_range_replicates_a_group_smaller_than_tp():
    # 2 KV heads over tp=8: head 0 on ranks 0-3, head 1 on ranks 4-7
    assert [expected_range(2, 8, r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [expected_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4


@pytest.mark.parametrize("group, tp_size, tp_rank", [(6, 4, 0), (3, 8, 0), (8, 4, 4), (8, 4, -1)])
def test_expected_range_refuses_uneven_or_impossible_splits(group, tp_size, tp_rank):
    with pytest.raises(GeometryError):
        expected_range(group, tp_size, tp_rank)


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_expected_range_covers_every_element_equally_often(group, tp_size):
    holders = np.zeros(group, dtype=int)
    for rank in range(tp_size):
        start, end = expected_range(group, tp_size, rank)
        holders[start:end] += 1
    assert np.all(holders == max(1, tp_size // group))


def test_shard_positions_concatenate_group_ranges_in_group_order():
    shard = ShardSpec.grouped((4, 4, 8), ((2, 4), (2, 4), (4, 8)))
    assert shard_positions(shard).tolist() == [2, 3, 6, 7, 12, 13, 14, 15]
    assert shard_positions(ShardSpec.plain(8, 2, 4)).tolist() == [2, 3]
