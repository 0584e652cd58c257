"""Pools in shared memory: one exact-size segment per region, removed on close."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pd_transfer.client import allocate_pools
from pd_transfer.errors import TransportError
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import WorkerShape, build_rank
from pd_transfer.layout.views import Layout
from pd_transfer.memory.segments import SEGMENT_DIR, open_segment

MODEL = model_from_table(
    {
        "name": "tiny",
        "num_layers": 2,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 4, "head_dim": 8},
    },
    "<tiny>",
)


def _geometry():
    return build_rank(
        MODEL,
        WorkerShape(
            role=Role.PREFILL,
            tp_size=2,
            tp_rank=0,
            page_size=4,
            kv_layout=Layout.NHD,
            num_pages=8,
            num_aux_rows=2,
        ),
    )


def _owner(request):
    return f"test-{os.getpid()}-{request.node.name}"


def test_allocate_pools_creates_one_exact_segment_per_region(request):
    geometry = _geometry()
    with allocate_pools(geometry, _owner(request)) as pools:
        assert set(pools.handles) == {r.id for r in geometry.regions}
        for region in geometry.regions:
            assert os.path.getsize(os.path.join(SEGMENT_DIR, pools.handles[region.id])) == region.nbytes
            assert pools.arrays[region.id].dtype == np.uint8
            assert pools.arrays[region.id].size == region.nbytes
        assert pools.nbytes == sum(r.nbytes for r in geometry.regions)
        names = list(pools.handles.values())
    assert not any(os.path.exists(os.path.join(SEGMENT_DIR, n)) for n in names)


def test_a_peer_sees_what_the_worker_writes_through_numpy_and_torch(request):
    geometry = _geometry()
    with allocate_pools(geometry, _owner(request)) as pools:
        region = geometry.regions[0].id
        pools.arrays[region][:4] = [1, 2, 3, 4]
        assert pools.tensors[region].dtype is torch.uint8
        pools.tensors[region][4] = 9
        peer = open_segment(pools.handles[region], geometry.regions[0].nbytes)
        assert peer.array[:5].tolist() == [1, 2, 3, 4, 9]
        peer.close()


def test_close_is_idempotent_and_unlinks(request):
    pools = allocate_pools(_geometry(), _owner(request))
    names = list(pools.handles.values())
    pools.close()
    pools.close()
    assert pools.closed and pools.handles == {}
    assert not any(os.path.exists(os.path.join(SEGMENT_DIR, n)) for n in names)


def test_a_failed_allocation_leaves_no_segment_behind(request):
    geometry = _geometry()
    owner = _owner(request)
    with allocate_pools(geometry, owner) as first:
        names = list(first.handles.values())
        with pytest.raises(TransportError, match="already exists"):
            allocate_pools(geometry, owner)
        # the clash was on the first region: nothing of the second attempt remains, and
        # the first owner's segments are untouched
        assert all(os.path.exists(os.path.join(SEGMENT_DIR, n)) for n in names)
    before = set(os.listdir(SEGMENT_DIR))
    with allocate_pools(geometry, owner):
        pass
    assert set(os.listdir(SEGMENT_DIR)) == before
