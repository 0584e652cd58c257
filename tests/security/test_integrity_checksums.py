"""Per-block checksums agree on both ends of correct transfers and name any flipped byte's block.

The bytes come from the oracle (:class:`pd_transfer.testing.World`): prefill
sums are computed from its source buffers chunk by chunk, as a prefill
sidecar does; decode sums from the destination buffers once the plan ran.
"""

import asyncio

import numpy as np
import pytest

from pd_transfer.layout.geometry import Role
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import Mode, reconcile
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.testing import World
from pd_transfer.transport import Fault, MockTransport, PeerEndpoint
from pd_transfer.transport.copy.checksums import BlockLayout, RoomDigest, compare, landed_digest
from pd_transfer.transport.copy.checksums import CopySide as Side

CASES = {
    "llama-tp2to4-sliced": ("llama-3.1-8b", 2, 4, Layout.NHD),
    "llama-tp4to2-hnd-two-sources": ("llama-3.1-8b", 4, 2, Layout.HND),
    "qwen3next-tp1to4-gqa-replicated-and-mamba": ("qwen3-next-80b-a3b", 1, 4, Layout.NHD),
    "deepseek-tp4to2-mla-single-writer": ("deepseek-v3", 4, 2, Layout.NHD),
    "gptoss-tp2to4-swa": ("gpt-oss-20b", 2, 4, Layout.NHD),
    "llama-tp2to2-page-first-converted": ("llama-3.1-8b", 2, 2, Layout.PAGE_FIRST),
}
NUM_PAGES = 8


def _setup(case: str, seed: int = 0):
    model, tp_src, tp_dst, layout = CASES[case]
    spec = load_preset(model)
    common = dict(page_size=16, num_pages=NUM_PAGES, num_slots=3, num_aux_rows=3)
    prefill = build_instance(spec, Role.PREFILL, tp_src, kv_layout=Layout.NHD, **common)
    decode = build_instance(spec, Role.DECODE, tp_dst, kv_layout=layout, **common)
    world = World.build(prefill, decode, seed)
    rng = np.random.default_rng(seed)
    requests = {Pool.KV: (rng.choice(NUM_PAGES, 4, replace=False), rng.choice(NUM_PAGES, 4, replace=False))}
    pools = {v.pool for g in decode for v in g.views}
    for pool, n in ((Pool.SWA, 2), (Pool.MAMBA, 1), (Pool.AUX, 1)):
        if pool in pools:
            limit = 3 if pool is not Pool.SWA else NUM_PAGES
            requests[pool] = (rng.choice(limit, n, replace=False), rng.choice(limit, n, replace=False))
    return prefill, decode, world, requests


def _chunks(requests):
    """Two chunks as a prefill sidecar sends them: half the KV pages, then the rest and the state."""
    src, dst = requests[Pool.KV]
    first = {Pool.KV: (src[:2], dst[:2])}
    last = {Pool.KV: (src[2:], dst[2:]), **{p: r for p, r in requests.items() if p is not Pool.KV}}
    return [(first, 0), (last, 2)]


def _pairs(prefill, decode, dst_geometry):
    recon = reconcile(prefill, [dst_geometry])
    by_rank = {g.rank_id: g for g in prefill}
    return recon, [
        (by_rank[r], PairPlanner(recon, by_rank[r], dst_geometry)) for r in recon.sources_for(dst_geometry)
    ]


def _sent_digest(layout, planner, requests, world, src_rank, execute=True):
    digest = RoomDigest(layout, {pool: len(d) for pool, (_, d) in requests.items()})
    for chunk, kv_start in _chunks(requests):
        if execute:
            world.execute(planner.plan(chunk))
        digest.add_sent(chunk, {Pool.KV: kv_start}, world.prefill_buffers[src_rank])
    return {pool: (d.items, d.tensors) for pool, d in digest.pools.items()}


def _dst(requests):
    return {pool: d for pool, (_, d) in requests.items()}


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_sums_agree_on_every_correct_transfer(case):
    prefill, decode, world, requests = _setup(case)
    for dst_geometry in decode:
        recon, pairs = _pairs(prefill, decode, dst_geometry)
        for src_geometry, planner in pairs:
            layout = BlockLayout(planner)
            sent = _sent_digest(layout, planner, requests, world, src_geometry.rank_id)
            landed = landed_digest(layout, _dst(requests), world.decode_buffers[dst_geometry.rank_id])
            assert compare(layout, _dst(requests), sent, landed) == "", (
                src_geometry.rank_id,
                dst_geometry.rank_id,
            )
            assert set(landed) == set(layout.pools) & set(requests)
    assert world.verify(requests) == []  # the transfers the sums vouched for were right


def test_cases_cover_sliced_replicated_converted_and_state():
    modes = set()
    for case in CASES:
        prefill, decode, _, _ = _setup(case)
        modes |= {
            (p.value, m) for p, by_mode in reconcile(prefill, decode).modes_by_pool().items() for m in by_mode
        }
    assert {
        ("kv", Mode.SLICED),
        ("kv", Mode.REPLICATED),
        ("kv", Mode.CONVERTED),
        ("mamba", Mode.SLICED),
        ("swa", Mode.SLICED),
    } <= modes


@pytest.mark.parametrize("case", CASES)
def test_a_flipped_byte_in_any_block_names_that_block(case):
    prefill, decode, world, requests = _setup(case, seed=1)
    dst_geometry = decode[-1]
    _, pairs = _pairs(prefill, decode, dst_geometry)
    rng = np.random.default_rng(2)
    for src_geometry, planner in pairs:
        layout = BlockLayout(planner)
        sent = _sent_digest(layout, planner, requests, world, src_geometry.rank_id)
        buffers = world.decode_buffers[dst_geometry.rank_id]
        for pool in layout.pools:
            if pool not in requests:
                continue
            dst = requests[pool][1]
            blocks = [(u, k) for u in range(layout.num_units(pool)) for k in range(len(dst))]
            picked = [blocks[0], blocks[-1]] + [blocks[i] for i in rng.choice(len(blocks), 12)]
            for unit, position in picked:
                region, offsets, nbytes = layout.block_runs(pool, unit, int(dst[position]), Side.DESTINATION)
                run = int(rng.integers(len(offsets)))
                at = int(offsets[run]) + int(rng.integers(int(nbytes[run])))
                original = int(buffers[region][at])
                buffers[region][at] ^= 1 << int(rng.integers(8))
                try:
                    text = compare(
                        layout, _dst(requests), sent, landed_digest(layout, _dst(requests), buffers)
                    )
                finally:
                    buffers[region][at] = original
                expected = layout.describe(pool, unit, position, dst)
                assert f"first bad block: {expected};" in text, text
                assert f"1 of {len(dst)} " in text and f"1 of {layout.num_units(pool)} tensor" in text


def test_a_flip_in_what_another_source_wrote_does_not_blame_this_source():
    prefill, decode, world, requests = _setup("llama-tp4to2-hnd-two-sources", seed=3)
    dst_geometry = decode[0]
    _, pairs = _pairs(prefill, decode, dst_geometry)
    assert len(pairs) == 2  # decode tp=2 < prefill tp=4: each decode page is written by two ranks
    (_, planner_a), (src_b, planner_b) = pairs
    layout_a, layout_b = BlockLayout(planner_a), BlockLayout(planner_b)
    for _, planner in pairs:
        for chunk, _ in _chunks(requests):
            world.execute(planner.plan(chunk))
    sent_b = _sent_digest(layout_b, planner_b, requests, world, src_b.rank_id, execute=False)
    dst = requests[Pool.KV][1]
    region, offsets, _ = layout_a.block_runs(Pool.KV, 0, int(dst[0]), Side.DESTINATION)
    world.decode_buffers[dst_geometry.rank_id][region][int(offsets[0])] ^= 0xFF
    landed_b = landed_digest(layout_b, _dst(requests), world.decode_buffers[dst_geometry.rank_id])
    assert compare(layout_b, _dst(requests), sent_b, landed_b) == ""
    assert world.verify(requests) != []  # ... while the byte really is wrong


def test_mock_transport_corruption_is_caught_by_the_destination_sums():
    prefill, decode, world, requests = _setup("llama-tp2to4-sliced", seed=4)
    dst_geometry = decode[1]
    _, [(src_geometry, planner)] = _pairs(prefill, decode, dst_geometry)
    layout = BlockLayout(planner)
    buffers = world.decode_buffers[dst_geometry.rank_id]
    transport = MockTransport(
        {dst_geometry.rank_id: buffers}, faults=[Fault.corrupt(on_write=2, byte_index=12345)]
    )

    async def run():
        link = await transport.connect(
            PeerEndpoint.from_maps(dst_geometry.rank_id, {r: len(a) for r, a in buffers.items()})
        )
        for chunk, _ in _chunks(requests):
            await transport.write(link, planner.plan(chunk), world.prefill_buffers[src_geometry.rank_id])
        await transport.close()

    asyncio.run(run())
    sent = _sent_digest(layout, planner, requests, world, src_geometry.rank_id, execute=False)
    text = compare(layout, _dst(requests), sent, landed_digest(layout, _dst(requests), buffers))
    # the second write carried positions 2 and 3 (and aux): the flipped byte is in one of them
    assert "first bad block:" in text and "1 of 4 page(s)" in text, text
    assert "(position 2)" in text or "(position 3)" in text, text
    assert [w.faults for w in transport.writes][1]


def test_summaries_stay_small_for_long_rooms():
    prefill, decode, world, _ = _setup("llama-tp2to4-sliced")
    _, [(src_geometry, planner)] = _pairs(prefill, decode, decode[0])
    layout = BlockLayout(planner)
    pages = np.arange(NUM_PAGES)
    digest = RoomDigest(layout, {Pool.KV: NUM_PAGES})
    digest.add_sent({Pool.KV: (pages, pages)}, {}, world.prefill_buffers[src_geometry.rank_id])
    kv = digest.pools[Pool.KV]
    # one sum per page plus one per tensor piece, not one per (page, tensor): 8 + 64, not 512
    assert (len(kv.items), len(kv.tensors)) == (NUM_PAGES, layout.num_units(Pool.KV)) == (8, 64)


def test_positions_must_arrive_in_order():
    prefill, decode, world, _ = _setup("llama-tp2to4-sliced")
    _, [(src_geometry, planner)] = _pairs(prefill, decode, decode[0])
    digest = RoomDigest(BlockLayout(planner), {Pool.KV: 4})
    chunk = {Pool.KV: (np.array([1]), np.array([2]))}
    with pytest.raises(ValueError, match="positions"):
        digest.add_sent(chunk, {Pool.KV: 2}, world.prefill_buffers[src_geometry.rank_id])
