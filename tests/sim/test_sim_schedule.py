"""Both sides derive the same schedule; rooms in flight never share an index."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pd_transfer.errors import ConfigError
from pd_transfer.layout.views import Pool
from pd_transfer.sim.schedule import ROOM_STRIDE, PoolSizes, ScheduleSpec, build_schedule

PREFILL = PoolSizes(num_pages=100, num_swa_pages=40, num_slots=4, num_aux_rows=4)
DECODE = PoolSizes(num_pages=90, num_swa_pages=30, num_slots=5, num_aux_rows=6)
SPEC = ScheduleSpec(
    seed=3,
    num_requests=11,
    tokens=70,
    page_size=16,
    window=4,
    prefill=PREFILL,
    decode=DECODE,
    swa_pages_per_request=3,
    uses_state=True,
)


def test_schedule_is_the_same_when_derived_twice():
    first, second = build_schedule(SPEC), build_schedule(SPEC)
    for a, b in zip(first, second, strict=True):
        assert (a.room, a.window_slot, a.content_seed, a.state_slot, a.aux_row) == (
            b.room,
            b.window_slot,
            b.content_seed,
            b.state_slot,
            b.aux_row,
        )
        for name in ("src_pages", "dst_pages", "src_swa_pages", "dst_swa_pages"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_requests_get_rooms_slots_and_page_counts_from_the_spec():
    requests = build_schedule(SPEC)
    assert [r.room for r in requests] == [3 * ROOM_STRIDE + i for i in range(11)]
    assert [r.window_slot for r in requests] == [i % 4 for i in range(11)]
    assert all(len(r.src_pages) == len(r.dst_pages) == 5 for r in requests)  # ceil(70 / 16)
    assert all(len(r.src_swa_pages) == len(r.dst_swa_pages) == 3 for r in requests)
    assert all(r.state_slot == r.aux_row == r.window_slot for r in requests)
    assert len({r.content_seed for r in requests}) == 11


def test_rooms_in_flight_together_share_no_page():
    requests = build_schedule(SPEC)
    for start in range(len(requests) - SPEC.window + 1):
        in_flight = requests[start : start + SPEC.window]
        for name in ("src_pages", "dst_pages", "src_swa_pages", "dst_swa_pages"):
            pages = np.concatenate([getattr(r, name) for r in in_flight])
            assert np.unique(pages).size == pages.size, (start, name)


def test_pages_stay_inside_each_sides_pool():
    requests = build_schedule(SPEC)
    assert max(int(r.src_pages.max()) for r in requests) < PREFILL.num_pages
    assert max(int(r.dst_pages.max()) for r in requests) < DECODE.num_pages
    assert max(int(r.dst_swa_pages.max()) for r in requests) < DECODE.num_swa_pages


def test_swa_pages_are_capped_at_the_requests_pages():
    spec = dataclasses.replace(SPEC, tokens=20)  # 2 pages, window needs 3
    assert all(len(r.src_swa_pages) == 2 for r in build_schedule(spec))


def test_chunks_concatenate_to_the_source_pages_in_order():
    request = build_schedule(SPEC)[0]
    chunks = request.chunks(2)
    assert [len(c) for c in chunks] == [2, 2, 1]
    np.testing.assert_array_equal(np.concatenate(chunks), request.src_pages)


def test_transfer_indices_name_every_pool_used():
    request = build_schedule(SPEC)[5]
    indices = request.transfer_indices()
    assert set(indices) == {Pool.KV, Pool.SWA, Pool.MAMBA, Pool.AUX}
    assert indices[Pool.MAMBA][0].tolist() == indices[Pool.MAMBA][1].tolist() == [1]


def test_unshuffled_schedule_hands_out_pages_in_order():
    spec = dataclasses.replace(SPEC, shuffle=False)
    assert build_schedule(spec)[1].src_pages.tolist() == [25, 26, 27, 28, 29]


def test_a_pool_too_small_for_the_window_is_refused_naming_it():
    spec = dataclasses.replace(SPEC, decode=dataclasses.replace(DECODE, num_pages=19))
    with pytest.raises(
        ConfigError,
        match=r"decode.num_pages is 19 but 4 rooms in flight need "
        r"5 pages each \(20\)",
    ):
        build_schedule(spec)


def test_state_slots_are_required_for_state_models():
    spec = dataclasses.replace(SPEC, prefill=dataclasses.replace(PREFILL, num_slots=3))
    with pytest.raises(ConfigError, match="prefill.num_slots is 3"):
        build_schedule(spec)
