"""The copy engine moves exactly the oracle's bytes, on every path, and refuses bad runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.layout.views import Layout
from pd_transfer.transport.copy import native_loop as native_copy
from pd_transfer.transport.copy.copy_engine import CopyEngine
from pd_transfer.transport.copy.runs import row_nbytes_for, rows_of

# Each engine configuration forces one copy path through the same plans: numpy's
# (native=False) and, where it is built, the native copy loop's.
ENGINES = {
    "direct-runs": dict(direct_max_runs=1 << 30, native=False),
    "bounce": dict(
        direct_max_runs=0, stretch_nbytes=1 << 30, bounce_nbytes=64 << 10, num_workers=1, native=False
    ),
    "stretch": dict(direct_max_runs=0, stretch_nbytes=512, native=False),
    "bounce-2-workers": dict(
        direct_max_runs=0,
        stretch_nbytes=1 << 30,
        bounce_nbytes=32 << 10,
        inline_nbytes=0,
        num_workers=2,
        native=False,
    ),
    "3-workers-small-stretches": dict(
        direct_max_runs=0,
        inline_nbytes=0,
        num_workers=3,
        stretch_nbytes=4096,
        bounce_nbytes=8192,
        native=False,
    ),
    "default": dict(),
}
if native_copy.AVAILABLE:
    ENGINES.update(
        {
            "native-direct-runs": dict(direct_max_runs=1 << 30, native=True),
            "native-1-worker": dict(direct_max_runs=0, num_workers=1, native=True),
            "native-3-workers": dict(direct_max_runs=0, inline_nbytes=0, num_workers=3, native=True),
        }
    )

CASES = {
    "direct tp2->2": dict(kind="llama", prefill_tp=2, decode_tp=2),
    "sliced tp2->4": dict(kind="llama", prefill_tp=2, decode_tp=4),
    "sliced tp4->2": dict(kind="llama", prefill_tp=4, decode_tp=2),
    "converted nhd->page_first": dict(kind="llama", prefill_tp=2, decode_tp=2, dst_layout=Layout.PAGE_FIRST),
    "converted hnd->nhd tp2->4": dict(kind="llama", prefill_tp=2, decode_tp=4, src_layout=Layout.HND),
    "gdn state tp2->4": dict(kind="gdn", prefill_tp=2, decode_tp=4),
    "gdn state tp4->1": dict(kind="gdn", prefill_tp=4, decode_tp=1),
}


@pytest.fixture(scope="module")
def engines():
    made = {name: CopyEngine(**kwargs) for name, kwargs in ENGINES.items()}
    yield made
    for engine in made.values():
        engine.close()


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_matches_oracle_byte_for_byte(scenario, engines, case, engine_name):
    sc = scenario(**CASES[case])
    engine = engines[engine_name]
    total = 0
    for plan in sc.plans:
        total += engine.execute(plan, sc.src(plan), sc.dst(plan))
    assert total == sum(plan.total_nbytes for plan in sc.plans) > 0
    assert sc.world.verify(sc.requests) == []


def test_engine_accepts_torch_tensors_and_returns_bytes(scenario):
    sc = scenario("llama", 2, 4)
    for plan in sc.plans:
        src = {k: torch.from_numpy(v) for k, v in sc.src(plan).items()}
        dst = {k: torch.from_numpy(v) for k, v in sc.dst(plan).items()}
        for native in {False, native_copy.AVAILABLE}:
            engine = CopyEngine(native=native, direct_max_runs=0)
            assert engine.execute(plan, src, dst) == plan.total_nbytes
    assert sc.world.verify(sc.requests) == []


# -- bounds: nothing moves when any run is outside a region -------------------------------
GUARD = 64


def _guarded(size: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """A region with GUARD bytes of known value on both sides of it."""
    whole = np.full(size + 2 * GUARD, 0xAB, np.uint8)
    region = whole[GUARD : GUARD + size]
    region[:] = fill
    return whole, region


def _plan(*batches: RunBatch) -> TransferPlan:
    return TransferPlan("p0", "d0", batches)


def _batch(
    src_offsets, dst_offsets, nbytes, count=None, src_stride=0, dst_stride=0, src="s", dst="d"
) -> RunBatch:
    n = len(src_offsets)
    return RunBatch(
        src,
        dst,
        np.array(src_offsets, np.int64),
        np.array(dst_offsets, np.int64),
        np.array(nbytes, np.int64),
        np.array(count or [1] * n, np.int64),
        src_stride,
        dst_stride,
    )


BAD_RUNS = {
    "past the end": (_batch([0, 0], [0, 4000], [64, 128]), "destination", "4000"),
    "negative offset": (_batch([0], [-8], [16]), "destination", "-8"),
    "last strided piece past the end": (
        _batch([0], [0], [16], count=[300], src_stride=0, dst_stride=16),
        "destination",
        "last piece ends at 4800",
    ),
    "source past the end": (_batch([2048 - 8], [0], [16]), "source", "2040"),
    "overflowing length": (_batch([8], [0], [2**62]), "source", "offset 8"),
    "overflowing stride": (
        _batch([0], [0], [1], count=[3], src_stride=2**62, dst_stride=1),
        "source",
        "stride",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_out_of_region_run_is_refused_and_nothing_is_written(case):
    bad, side, mentioned = BAD_RUNS[case]
    good = _batch([0, 256], [0, 512], [128, 128])
    src = np.arange(2048, dtype=np.int64).astype(np.uint8)
    whole, dst = _guarded(4096, 7)
    before = whole.copy()
    with pytest.raises(TransportError) as info:
        CopyEngine().execute(_plan(good, bad), {"s": src}, {"d": dst})
    assert info.value.code is Reason.RUN_OUT_OF_REGION
    message = str(info.value)
    region_id, size = ("d", 4096) if side == "destination" else ("s", 2048)
    assert f"{side} region {region_id!r} of {size} bytes" in message
    assert "batch 1 descriptor" in message and mentioned in message
    assert "nothing was copied" in message
    assert np.array_equal(whole, before)  # the good batch did not move either; guards intact


def test_unknown_region_is_refused_before_copying():
    src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
    plan = _plan(_batch([0], [0], [8]), _batch([0], [0], [8], dst="nowhere"))
    with pytest.raises(TransportError) as info:
        CopyEngine().execute(plan, {"s": src}, {"d": dst})
    assert info.value.code is Reason.UNKNOWN_REGION and "'nowhere'" in str(info.value)
    assert not dst.any()


@pytest.mark.parametrize(
    "region",
    [np.zeros(16, np.float32), np.zeros((4, 4), np.uint8), torch.zeros(16, dtype=torch.int16), [0] * 16],
)
def test_region_that_is_not_flat_uint8_memory_is_refused(region):
    with pytest.raises(TransportError) as info:
        CopyEngine().execute(_plan(_batch([0], [0], [4])), {"s": np.ones(16, np.uint8)}, {"d": region})
    assert info.value.code is Reason.REGION_INVALID


def test_engine_guards_with_its_bounce_path_as_well():
    """The check runs before path selection: a big plan with one bad run moves nothing."""
    n = 4096
    src = np.arange(n * 64, dtype=np.int64).astype(np.uint8)
    whole, dst = _guarded(n * 64, 0)
    offsets = np.random.default_rng(0).permutation(n) * 64
    runs = _batch(offsets, np.arange(n) * 64, [64] * n)
    bad = _batch([0], [n * 64 - 32], [64])
    with pytest.raises(TransportError):
        CopyEngine(native=False, direct_max_runs=0, inline_nbytes=0).execute(
            _plan(runs, bad), {"s": src}, {"d": dst}
        )
    assert not whole[GUARD:-GUARD].any() and (whole[:GUARD] == 0xAB).all()


# -- row arithmetic -----------------------------------------------------------------------
def test_rows_of_expands_runs_in_order():
    assert rows_of(np.array([32, 0]), np.array([32, 16]), 16).tolist() == [2, 3, 0]
    assert rows_of(np.array([48, 16]), np.array([16, 16]), 16).tolist() == [3, 1]
    assert rows_of(np.array([64, 0]), np.array([32, 32]), 16).tolist() == [4, 5, 0, 1]


def test_row_size_is_the_largest_common_divisor_under_the_cap():
    assert row_nbytes_for(np.array([16384, 32768]), np.array([16384]), cap=1 << 20) == 16384
    assert row_nbytes_for(np.array([0]), np.array([3 << 20]), cap=1 << 20) == 1 << 20
    assert row_nbytes_for(np.array([0]), np.array([3 * 5 * 7 * 4096]), cap=64 << 10) == 3 * 5 * 4096


# -- property: any non-overlapping run set lands exactly as a naive loop would -------------
@st.composite
def run_sets(draw):
    size = 8192
    align = draw(st.sampled_from([1, 2, 8, 64, 512]))
    slots = size // align
    n = draw(st.integers(1, min(40, slots)))
    lengths = draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    # destination: disjoint runs, in shuffled order; source: anywhere
    starts = sorted(draw(st.lists(st.integers(0, slots - 1), min_size=n, max_size=n, unique=True)))
    runs = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < n else slots
        length = min(lengths[i], end - start)
        src = draw(st.integers(0, slots - length))
        runs.append((src * align, start * align, length * align))
    order = draw(st.permutations(range(n)))
    return [runs[i] for i in order], size


@settings(max_examples=60, deadline=None)
@given(run_sets(), st.sampled_from(sorted(ENGINES)))
def test_engine_equals_naive_copy_for_any_disjoint_runs(case, engine_name):
    runs, size = case
    src = np.random.default_rng(len(runs)).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    expected = dst.copy()
    for s, d, n in runs:
        expected[d : d + n] = src[s : s + n]
    s, d, n = (list(x) for x in zip(*runs))
    CopyEngine(**ENGINES[engine_name]).execute(_plan(_batch(s, d, n)), {"s": src}, {"d": dst})
    assert np.array_equal(dst, expected)


@st.composite
def strided_plans(draw):
    """Descriptors with several pieces, strided on both sides; destination areas disjoint."""
    size = 16384
    align = draw(st.sampled_from([1, 4, 64]))
    batches, cursor = [], 0
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 6))
        nbytes = align * draw(st.integers(1, 4))
        count = draw(st.integers(1, 5))
        dst_stride = nbytes + align * draw(st.sampled_from([0, 0, 1, 3]))  # 0: back to back
        src_stride = align * draw(st.integers(-8, 8))
        src, dst = [], []
        for _ in range(n):
            span = (count - 1) * dst_stride + nbytes
            if cursor + span > size:
                break
            dst.append(cursor)
            cursor += span + align * draw(st.integers(0, 2))
            low = max(0, -(count - 1) * src_stride)
            high = size - nbytes - max(0, (count - 1) * src_stride)
            src.append(draw(st.integers(low // align, high // align)) * align)
        if src:
            order = draw(st.permutations(range(len(src))))
            batches.append(
                _batch(
                    [src[i] for i in order],
                    [dst[i] for i in order],
                    [nbytes] * len(src),
                    [count] * len(src),
                    src_stride,
                    dst_stride,
                )
            )
    return batches, size


@settings(max_examples=60, deadline=None)
@given(strided_plans(), st.sampled_from(sorted(ENGINES)))
def test_engine_equals_naive_copy_for_strided_descriptors(case, engine_name):
    batches, size = case
    src = np.random.default_rng(len(batches)).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    expected = dst.copy()
    for b in batches:
        for s, d, n, c in zip(b.src_offset, b.dst_offset, b.nbytes, b.count):
            for j in range(c):
                a, z = s + j * b.src_stride, d + j * b.dst_stride
                expected[z : z + n] = src[a : a + n]
    CopyEngine(**ENGINES[engine_name]).execute(_plan(*batches), {"s": src}, {"d": dst})
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("piece_nbytes, kind", [(512, "TakeInto"), (16 << 10, "Bounce")])
def test_a_mid_length_stretch_of_small_pieces_is_gathered_in_place_and_of_pages_bounced(piece_nbytes, kind):
    """A 96 KiB destination stretch (under the 128 KiB stretch length, over half of it):
    512-byte head slices go straight into the destination (no second pass through a
    bounce buffer), 16 KiB page runs through the bounce buffer; both copy exactly."""
    from pd_transfer.transport.copy.runs import flatten
    from pd_transfer.transport.copy.tasks import compile_tasks
    from pd_transfer.transport.regions import map_regions

    count = (96 << 10) // piece_nbytes
    # source pieces at twice their length apart (every other slice), destination packed
    batch = _batch([0], [4096], [piece_nbytes], [count], src_stride=2 * piece_nbytes, dst_stride=piece_nbytes)
    rng = np.random.default_rng(piece_nbytes)
    src = rng.integers(0, 256, 2 * count * piece_nbytes, dtype=np.uint8)
    dst = np.zeros(4096 + count * piece_nbytes + 4096, np.uint8)
    mapped_src, mapped_dst = (
        map_regions({"s": src}, ["s"], "source"),
        map_regions({"d": dst}, ["d"], "destination"),
    )
    engine = CopyEngine(native=False, direct_max_runs=0)
    tasks = compile_tasks(
        flatten(_plan(batch)),
        mapped_src,
        mapped_dst,
        stretch_nbytes=engine.stretch_nbytes,
        bounce_nbytes=engine.bounce_nbytes,
    )
    assert [type(task).__name__ for task in tasks] == [kind]
    engine.execute(_plan(batch), {"s": src}, {"d": dst})
    expected = src.reshape(count, 2 * piece_nbytes)[:, :piece_nbytes].ravel()
    assert np.array_equal(dst[4096 : 4096 + count * piece_nbytes], expected)
    assert not dst[:4096].any() and not dst[4096 + count * piece_nbytes :].any()


# -- stretches in the source, long tasks split, the sort ----------------------------------
def _task_kinds(plan, src, dst, **engine_kwargs):
    from pd_transfer.transport.copy.runs import flatten
    from pd_transfer.transport.copy.tasks import compile_tasks
    from pd_transfer.transport.regions import map_regions

    engine = CopyEngine(native=False, direct_max_runs=0, **engine_kwargs)
    tasks = compile_tasks(
        flatten(plan),
        map_regions(src, list(src), "source"),
        map_regions(dst, list(dst), "destination"),
        stretch_nbytes=engine.stretch_nbytes,
        bounce_nbytes=engine.bounce_nbytes,
    )
    return [type(task).__name__ for task in tasks]


def test_pages_back_to_back_in_the_source_are_scattered_straight_from_it():
    """A request on fresh prefill pages (one 4 MiB source stretch) landing on scattered
    decode pages: put from the source in one pass, no bounce; exact bytes."""
    page, n = 16 << 10, 256
    rng = np.random.default_rng(3)
    dst_pages = rng.permutation(4 * n)[:n]
    plan = _plan(_batch(np.arange(n) * page, dst_pages * page, [page] * n))
    src = rng.integers(0, 256, n * page, dtype=np.uint8)
    dst = np.zeros(4 * n * page, np.uint8)
    assert set(_task_kinds(plan, {"s": src}, {"d": dst})) == {"PutFrom"}
    CopyEngine(native=False, direct_max_runs=0, inline_nbytes=0).execute(plan, {"s": src}, {"d": dst})
    expected = np.zeros_like(dst)
    for i, p in enumerate(dst_pages.tolist()):
        expected[p * page : (p + 1) * page] = src[i * page : (i + 1) * page]
    assert np.array_equal(dst, expected)


def test_random_pieces_of_a_sparse_source_are_bounced_not_sorted_by_source():
    page, n = 2048, 512
    rng = np.random.default_rng(4)
    plan = _plan(_batch(rng.permutation(4 * n)[:n] * page, rng.permutation(4 * n)[:n] * page, [page] * n))
    kinds = _task_kinds(
        plan, {"s": np.zeros(4 * n * page, np.uint8)}, {"d": np.zeros(4 * n * page, np.uint8)}
    )
    assert set(kinds) == {"Bounce"}


@st.composite
def scattered_pieces(draw):
    """Pieces of one power-of-two size at random distinct slots of one or two destination
    regions, some of them in runs of consecutive slots; the source as sparse or as
    dense as drawn."""
    size = draw(st.sampled_from([1, 64, 512, 2048]))
    slots = 64
    batches, used_src = [], draw(st.integers(8, 48))
    src_slots = draw(st.permutations(range(slots)))[:used_src]
    at = 0
    for region in ("d", "e")[: draw(st.integers(1, 2))]:
        n = min(draw(st.integers(2, 24)), used_src - at)
        if n < 2:
            break
        free = draw(st.permutations(range(slots)))
        dst_slots = list(free[:n])
        run = draw(st.integers(0, 6))  # a run of consecutive destination slots at the start
        dst_slots[: min(run, n)] = range(40, 40 + min(run, n))
        dst_slots = list(dict.fromkeys(dst_slots))  # distinct, the run first
        dst_slots += [x for x in free if x not in dst_slots][: n - len(dst_slots)]
        order = draw(st.permutations(range(n)))
        batches.append(
            _batch(
                [src_slots[at + i] * size for i in order],
                [dst_slots[i] * size for i in order],
                [size] * n,
                dst=region,
            )
        )
        at += n
    return batches, size, slots


@settings(max_examples=80, deadline=None)
@given(scattered_pieces(), st.booleans())
def test_scattered_pieces_of_one_size_are_bounced_by_the_shortcut_exactly(case, two_workers):
    """Same-size pieces one per descriptor: the shortcut bounces them when the source is
    sparse and no destination run is long enough to fill in place, and leaves every
    other plan to the general compiler; either way the bytes are the oracle's."""
    from pd_transfer.transport.copy.runs import flatten
    from pd_transfer.transport.copy.tasks import SOURCE_FILL_MIN, _uniform_bounce
    from pd_transfer.transport.regions import map_regions

    batches, size, slots = case
    stretch = 8 * size
    src = np.random.default_rng(size).integers(0, 256, slots * size, dtype=np.uint8)
    dst = {r: np.zeros(slots * size, np.uint8) for r in ("d", "e")}
    expected = {r: a.copy() for r, a in dst.items()}
    for b in batches:
        for s, d in zip(b.src_offset.tolist(), b.dst_offset.tolist()):
            expected[b.dst_region][d : d + size] = src[s : s + size]
    plan = _plan(*batches)
    flat = flatten(plan)
    shortcut = _uniform_bounce(
        flat,
        map_regions({"s": src}, ["s"], "source"),
        map_regions(dst, list(dst), "destination"),
        stretch,
        1 << 20,
    )
    spans = [(b.src_offset.max() - b.src_offset.min() + size) for b in batches]
    sparse = sum(len(b.src_offset) * size for b in batches) / sum(spans) <= SOURCE_FILL_MIN
    k = (stretch // 2 if size < 4096 else stretch) // size  # rows of a stretch filled in place
    long_run = any(
        any(
            set(range(x, x + k)) <= set((b.dst_offset // size).tolist())
            for x in (b.dst_offset // size).tolist()
        )
        for b in batches
    )
    assert (shortcut is not None) == (sparse and not long_run)
    CopyEngine(
        native=False,
        direct_max_runs=0,
        inline_nbytes=0,
        num_workers=2 if two_workers else 1,
        stretch_nbytes=stretch,
        bounce_nbytes=4 * size,
    ).execute(plan, {"s": src}, dst)
    for region in dst:
        assert np.array_equal(dst[region], expected[region])


def test_a_long_run_is_cut_into_tasks_the_threads_share():
    nbytes = (10 << 20) + 5
    src = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 3, np.uint8)
    plan = _plan(_batch([0], [3], [nbytes]))
    assert _task_kinds(plan, {"s": src}, {"d": dst}) == ["CopyRun"] * 3
    CopyEngine(native=False, direct_max_runs=0, inline_nbytes=0).execute(plan, {"s": src}, {"d": dst})
    assert np.array_equal(dst[3:], src) and not dst[:3].any()


@st.composite
def source_stretches(draw):
    """Pieces back to back in the source (a few stretches, now and then a gap),
    destinations disjoint and shuffled: put, gather and bounce tasks in one plan."""
    align = draw(st.sampled_from([1, 8, 64]))
    lengths = draw(st.lists(st.integers(1, 6), min_size=2, max_size=40))
    slots = sum(lengths) * 2
    size = slots * align
    order = draw(st.permutations(range(len(lengths))))
    # destination: each piece its own slot range, in shuffled order
    starts, cursor = [0] * len(lengths), 0
    for i in order:
        starts[i] = cursor
        cursor += lengths[i] + draw(st.integers(0, 1))
    src_offsets, at = [], draw(st.integers(0, 3))
    for length in lengths:
        src_offsets.append(at * align)
        at += length + (1 if draw(st.integers(0, 5)) == 0 else 0)  # now and then a gap
    return (src_offsets, [s * align for s in starts], [n * align for n in lengths]), max(
        size, (at + 1) * align, (cursor + 1) * align
    )


@settings(max_examples=60, deadline=None)
@given(source_stretches(), st.sampled_from([16, 64, 512]))
def test_engine_equals_naive_copy_for_pieces_back_to_back_in_the_source(case, stretch):
    (s, d, n), size = case
    src = np.random.default_rng(len(s)).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    expected = dst.copy()
    for a, z, k in zip(s, d, n):
        expected[z : z + k] = src[a : a + k]
    CopyEngine(
        native=False,
        direct_max_runs=0,
        stretch_nbytes=stretch,
        bounce_nbytes=64,
        inline_nbytes=0,
        num_workers=2,
    ).execute(_plan(_batch(s, d, n)), {"s": src}, {"d": dst})
    assert np.array_equal(dst, expected)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5000)), min_size=0, max_size=300),
    st.sampled_from([1, 3, 512, 2048]),
    st.booleans(),
)
def test_batch_order_sorts_by_batch_then_offset(pairs, row, many):
    from pd_transfer.transport.copy.runs import batch_order

    if many:  # many pieces: two batches of distinct offsets
        rng = np.random.default_rng(len(pairs))  # spread over twice as many slots,
        n = 4096 + len(pairs)  # with a few duplicates now and then
        offsets = [rng.permutation(2 * n)[:n] for _ in range(2)]
        offsets[1][: len(pairs) // 100] = offsets[1][-1]
        pairs = [(b, int(o)) for b in range(2) for o in offsets[b]]
    pairs.sort(key=lambda p: p[0])  # batches arrive in order, offsets in any order
    batch = np.array([p[0] for p in pairs], np.int64)
    offset = np.array([p[1] * row for p in pairs], np.int64)
    order = batch_order(batch, offset)
    got = np.arange(len(batch)) if order is None else np.asarray(order)
    assert sorted(got.tolist()) == list(range(len(batch)))
    assert list(zip(batch[got].tolist(), offset[got].tolist())) == sorted(
        zip(batch.tolist(), offset.tolist())
    )


def test_the_last_small_run_is_copied_after_every_other_task(monkeypatch):
    """Threads finish in any order: a parallel copy holds the plan's last run (a room's
    aux row) back until every other task has finished, then copies it."""
    import time as clock

    import pd_transfer.transport.copy.copy_engine as engine_module

    spans, compiled = [], []

    class Timed:
        def __init__(self, task, call):
            self.task, self.call = task, call

        def run(self, scratch):
            start = clock.perf_counter()
            self.task.run(scratch)
            clock.sleep(0.001)  # long enough for the other thread to overlap
            spans.append((self.call, start, clock.perf_counter()))

    real = engine_module.compile_tasks

    def recording(flat, *args, **kwargs):
        compiled.append(flat.total_nbytes)
        call = len(compiled)
        return [Timed(task, call) for task in real(flat, *args, **kwargs)]

    monkeypatch.setattr(engine_module, "compile_tasks", recording)
    n, page = 64, 4096
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, 2 * n * page + 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_pages, dst_pages = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
    plan = _plan(
        _batch(src_pages * page, dst_pages * page, [page] * n), _batch([2 * n * page], [2 * n * page], [64])
    )
    CopyEngine(
        native=False,
        direct_max_runs=0,
        inline_nbytes=0,
        num_workers=2,
        stretch_nbytes=1 << 30,
        bounce_nbytes=8192,
    ).execute(plan, {"s": src}, {"d": dst})
    assert compiled == [n * page, 64]  # the body, then the last run alone
    body = [span for span in spans if span[0] == 1]
    ((_, tail_start, _),) = [span for span in spans if span[0] == 2]
    assert len(body) > 2 and tail_start >= max(end for _, _, end in body)
    assert np.array_equal(dst[2 * n * page :], src[2 * n * page :])
    assert all(
        np.array_equal(dst[d * page : (d + 1) * page], src[s * page : (s + 1) * page])
        for s, d in zip(src_pages.tolist(), dst_pages.tolist())
    )
