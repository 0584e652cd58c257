"""Conformance kit: a ground-truth oracle for transfer plans.

Build a :class:`World` from the prefill and decode registrations, let the
code under test produce plans, :meth:`World.execute` them on numpy buffers,
then :meth:`World.verify` (or :meth:`World.assert_exact`) the result byte for
byte::

    world = World.build(prefill_geometries, decode_geometries, seed=0)
    for plan in plans:
        world.execute(plan)
    world.assert_exact({Pool.KV: (src_pages, dst_pages)})

Decode pages may hold another number of tokens than prefill's: a KV or SWA
request is then owed token by token (a plain pair starts both page lists at
token 0; a :class:`~pd_transfer.layout.spans.TokenSpan` places them), and
:meth:`World.verify` takes a list of requests for several rooms at once.

The kit is the independent truth the planner is checked against: it reads the
registered layout description (``pd_transfer.layout.views`` and
``geometry``) and recomputes shard ranges, placement and expected bytes
itself. It must never import ``pd_transfer.layout.planner``, ``reconcile``,
``lowering``, ``sharding``, ``token_map`` or ``page_sizes``, nor anything
above the layout layer (protocol, transport, agent, client).
"""

from pd_transfer.testing.logical import LogicalTensor
from pd_transfer.testing.shards import expected_range, shard_positions
from pd_transfer.testing.world import World

__all__ = ["LogicalTensor", "World", "expected_range", "shard_positions"]
