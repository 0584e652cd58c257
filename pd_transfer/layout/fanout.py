"""Which decode ranks a prefill rank feeds, knowing one decode rank's geometry.

A prefill sidecar must know how many decode ranks will ask it for a room's
data before it can call the room done on its side (the prefill worker frees
its pages then). Decode ranks of one instance register the same tensors with
their own canonical shard ranges (a group one rank holds whole, every rank
holds whole), so one decode rank's registration is a template for all of
them: rewrite its shard ranges for every decode TP rank and ask the rank
mapping which of them this prefill rank writes to.

Worked example: 8 KV heads, prefill tp=2, decode tp=4. Prefill rank 1 holds
heads [4,8) and feeds decode ranks 2 and 3; with 2 KV heads and decode tp=4
(heads replicated in pairs), prefill tp=2 rank 1 feeds decode ranks 2 and 3.

Pure.
"""

from __future__ import annotations

import dataclasses

from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.reconcile import Reconciliation
from pd_transfer.layout.views import ShardSpec, canonical_range


def decode_rank_as(template: RankGeometry, tp_rank: int) -> RankGeometry:
    """``template`` (a decode rank) as if it were ``tp_rank`` of the same instance."""
    views = []
    for view in template.views:
        shard = view.shard
        if shard is not None and not shard.is_full:
            # a group the template holds whole is replicated on every rank (Mamba2's B and C
            # with fewer groups than ranks); the others take their canonical range
            ranges = tuple(
                (0, g) if r == (0, g) else canonical_range(g, template.tp_size, tp_rank)
                for g, r in zip(shard.groups, shard.ranges)
            )
            shard = ShardSpec(shard.groups, ranges, shard.declared_groups)
        views.append(dataclasses.replace(view, shard=shard) if shard is not view.shard else view)
    return dataclasses.replace(template, tp_rank=tp_rank, views=tuple(views))


def decode_ranks_fed(
    reconciliation: Reconciliation, prefill_rank_id: str, decode_template: RankGeometry
) -> list[int]:
    """Decode TP ranks (same PP stage as the template) that ``prefill_rank_id`` writes to."""
    fed = []
    for tp_rank in range(decode_template.tp_size):
        peer = decode_rank_as(decode_template, tp_rank)
        if prefill_rank_id in reconciliation.sources_for(peer):
            fed.append(tp_rank)
    return fed
