"""A prefill rank knows which decode ranks it feeds from one decode registration."""

import pytest
from transfer_check import instance

from pd_transfer.layout.fanout import decode_rank_as, decode_ranks_fed
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.reconcile import reconcile


@pytest.mark.parametrize(
    "kind,tp_src,tp_dst",
    [("gqa", 2, 4), ("gqa", 4, 2), ("gqa2", 2, 8), ("mla", 4, 2), ("gdn", 2, 4), ("mla", 1, 4)],
)
def test_fanout_from_one_template_matches_the_full_instance(kind, tp_src, tp_dst):
    prefill = instance(kind, Role.PREFILL, tp_src)
    decode = instance(kind, Role.DECODE, tp_dst)
    full = reconcile(prefill, decode)
    for template in decode:
        single = reconcile(prefill, [template])
        for src in prefill:
            expected = [d.tp_rank for d in decode if src.rank_id in full.sources_for(d)]
            assert decode_ranks_fed(single, src.rank_id, template) == expected


def test_template_rewrite_gives_each_rank_its_own_geometry():
    decode = instance("gdn", Role.DECODE, 4)
    for rank in decode:
        assert decode_rank_as(decode[0], rank.tp_rank).views == rank.views
