"""Rank mapping: intersect explicit ranges, one writer per piece."""

from pd_transfer.layout.sharding import Holder, Piece, assign_pieces
from pd_transfer.layout.views import ShardSpec


def _holders(extent, tp, groups=None):
    return tuple(Holder(f"p{r}", r, ShardSpec.for_rank(extent, tp, r, groups)) for r in range(tp))


def test_scatter_takes_a_slice_of_one_source_rank():
    # 8 heads, prefill tp=2 -> decode tp=4: decode rank 3 holds [6,8) = local heads 2..3 of p1
    pieces, uncovered = assign_pieces(
        _holders(8, 2), ShardSpec.for_rank(8, 4, 3), 3, 2, src_tp_size=2, dst_tp_size=4
    )
    assert pieces == {"p1": (Piece(src_start=2, dst_start=0, length=2),)}
    assert uncovered == ()


def test_aggregation_assembles_from_several_source_ranks():
    pieces, _ = assign_pieces(_holders(8, 4), ShardSpec.for_rank(8, 2, 1), 1, 4, src_tp_size=4, dst_tp_size=2)
    assert pieces == {"p2": (Piece(0, 0, 2),), "p3": (Piece(0, 2, 2),)}


def test_gqa_replicated_source_heads_get_one_writer_each():
    # 2 KV heads over prefill tp=8: ranks 0-3 hold head 0, ranks 4-7 head 1
    holders = _holders(2, 8)
    # decode tp=2 rank 1 targets centre 6.0: ranks 5 and 6 tie, the lower writes
    pieces, _ = assign_pieces(holders, ShardSpec.for_rank(2, 2, 1), 1, 1, src_tp_size=8, dst_tp_size=2)
    assert list(pieces) == ["p5"] and pieces["p5"] == (Piece(0, 0, 1),)


def test_shard_groups_are_sliced_per_group():
    # GDN conv [q | k | v] = [2048 | 2048 | 4096], prefill tp=2 -> decode tp=4, decode rank 1
    groups = (2048, 2048, 4096)
    pieces, _ = assign_pieces(
        _holders(8192, 2, groups),
        ShardSpec.for_rank(8192, 4, 1, groups),
        1,
        2048,
        src_tp_size=2,
        dst_tp_size=4,
    )
    assert pieces == {"p0": (Piece(512, 0, 512), Piece(1536, 512, 512), Piece(3072, 1024, 1024))}


def test_replicated_tensor_is_written_by_the_aligned_source_rank():
    # MLA prefill tp=4 -> decode tp=2: decode rank d reads from the first rank of its block
    holders = tuple(Holder(f"p{r}", r, None) for r in range(4))
    writers = [
        next(iter(assign_pieces(holders, None, d, 1, src_tp_size=4, dst_tp_size=2)[0])) for d in range(2)
    ]
    assert writers == ["p0", "p2"]


def test_replicated_tensors_add_no_connection_beyond_the_sharded_ones():
    # 2 KV heads, prefill tp=8 (heads replicated 4x) -> decode tp=4: aux rows must come
    # from the rank that already writes the decode rank's KV head
    kv = _holders(2, 8)
    aux = tuple(Holder(f"p{r}", r, None) for r in range(8))
    for d in range(4):
        kv_writers, _ = assign_pieces(kv, ShardSpec.for_rank(2, 4, d), d, 1, src_tp_size=8, dst_tp_size=4)
        aux_writers, _ = assign_pieces(aux, None, d, 1, src_tp_size=8, dst_tp_size=4)
        assert set(aux_writers) == set(kv_writers)


def test_missing_source_rank_is_reported_as_uncovered():
    holders = _holders(8, 4)[:3]  # prefill rank 3 never registered
    _, uncovered = assign_pieces(holders, ShardSpec.for_rank(8, 2, 1), 1, 4, src_tp_size=4, dst_tp_size=2)
    assert [(u.group, u.start, u.end) for u in uncovered] == [(0, 6, 8)]
