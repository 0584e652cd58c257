"""Pool builders: the tensor views and regions of each memory pool of a rank.

Each builder takes model geometry (a spec), the global layer ids a rank holds
and the pool's size and layout, and returns :class:`PoolViews`. Split by
concept: KV on device (:mod:`.kv_device`) and host (:mod:`.kv_host`) behind
:mod:`.kv_pool`, linear-attention state (:mod:`.state_specs`, :mod:`.state`),
aux metadata rows (:mod:`.aux_rows`).

Pure; may import numpy, the standard library and ``pd_transfer.errors``, never
torch, asyncio, zmq or anything above ``pd_transfer.layout``.
"""

from pd_transfer.layout.pools.attention import AttentionSpec, KvPoolShape, MlaSpec
from pd_transfer.layout.pools.aux_rows import DEFAULT_AUX_FIELDS, AuxField, build_aux_rows
from pd_transfer.layout.pools.kv_pool import build_kv_pool, build_mla_pool
from pd_transfer.layout.pools.pool_views import PoolViews
from pd_transfer.layout.pools.state import build_state_pool
from pd_transfer.layout.pools.state_specs import (
    GdnSpec,
    KdaSpec,
    LinearSpec,
    Mamba2Spec,
    SideStateSpec,
    StateTensor,
)

__all__ = [
    "AttentionSpec",
    "AuxField",
    "DEFAULT_AUX_FIELDS",
    "GdnSpec",
    "KdaSpec",
    "KvPoolShape",
    "LinearSpec",
    "Mamba2Spec",
    "MlaSpec",
    "PoolViews",
    "SideStateSpec",
    "StateTensor",
    "build_aux_rows",
    "build_kv_pool",
    "build_mla_pool",
    "build_state_pool",
]
