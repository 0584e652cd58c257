"""The native copy loop moves exactly a naive copy's bytes, in any byte ranges, streamed or not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport.copy import native_loop as native_copy
from pd_transfer.transport.copy.copy_engine import CopyEngine
from pd_transfer.transport.copy.runs import flatten
from pd_transfer.transport.regions import map_one

needs_library = pytest.mark.skipif(
    not native_copy.AVAILABLE, reason=f"native copy loop unavailable: {native_copy.UNAVAILABLE_WHY}"
)


def _batch(src, dst, nbytes, count, src_stride=0, dst_stride=0) -> RunBatch:
    as64 = lambda values: np.array(values, np.int64)  # noqa: E731
    return RunBatch("s", "d", as64(src), as64(dst), as64(nbytes), as64(count), src_stride, dst_stride)


def _naive(plan: TransferPlan, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    want = dst.copy()
    for b in plan.batches:
        for s, d, n, c in zip(b.src_offset, b.dst_offset, b.nbytes, b.count):
            for k in range(c):
                s_k, d_k = s + k * b.src_stride, d + k * b.dst_stride
                want[d_k : d_k + n] = src[s_k : s_k + n]
    return want


def _pieces(plan, src, dst, **kwargs) -> native_copy.Pieces:
    return native_copy.Pieces(
        flatten(plan), {"s": map_one("s", src, "source")}, {"d": map_one("d", dst, "destination")}, **kwargs
    )


@st.composite
def scattered_plans(draw):
    """Disjoint destination slots of random sizes at odd addresses, sources anywhere,
    some descriptors strided, some empty."""
    sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=40))
    slot = max(sizes) + 17
    order = draw(st.permutations(range(len(sizes))))
    counts = draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
    src = [draw(st.integers(0, 5000)) for _ in sizes]
    dst = [3 + i * 4 * slot for i in order]  # 4 slots each: a strided descriptor stays inside
    return (
        _batch(src, dst, sizes, counts, src_stride=draw(st.integers(0, 400)), dst_stride=slot),
        draw(st.integers(1, 5)),
        draw(st.sampled_from([1, 16, 64, 1 << 62])),
    )


@needs_library
@given(scattered_plans())
@settings(max_examples=200, deadline=None)
def test_any_split_into_ranges_copies_exactly_the_naive_bytes(case):
    """Ranges cut pieces anywhere (not on 4 KiB here: align=1); streamed pieces start
    and end unaligned; empty and strided descriptors in between."""
    batch, parts, stream_min = case
    plan = TransferPlan("p0", "d0", (batch,))
    rng = np.random.default_rng(len(batch.src_offset))
    # the farthest source byte: offset 5000 + 2 strides of 400 + a 300-byte piece
    src = rng.integers(0, 256, 5000 + 2 * 400 + 300, dtype=np.uint8)
    dst = rng.integers(0, 256, int(batch.dst_offset.max()) + 4 * 400, dtype=np.uint8)
    want = _naive(plan, src, dst)
    pieces = _pieces(plan, src, dst, stream_min=stream_min)
    ranges = pieces.ranges(parts, align=1)
    assert sum(length for _, length in ranges) == pieces.nbytes == plan.total_nbytes
    for start, length in reversed(ranges):  # any order
        assert pieces.copy(start, length) == length
    assert np.array_equal(dst, want)


@needs_library
def test_one_huge_piece_is_shared_by_ranges_and_streamed():
    src = np.random.default_rng(1).integers(0, 256, (8 << 20) + 100, dtype=np.uint8)
    dst = np.zeros((8 << 20) + 200, np.uint8)
    plan = TransferPlan("p0", "d0", (_batch([7], [33], [8 << 20], [1]),))
    pieces = _pieces(plan, src, dst)
    assert pieces.stream_min == native_copy.STREAM_MIN_NBYTES  # a large plan streams
    ranges = pieces.ranges(3)
    assert len(ranges) == 3 and all(start % 4096 == 0 for start, _ in ranges)
    for start, length in ranges:
        pieces.copy(start, length)
    assert np.array_equal(dst[33 : 33 + (8 << 20)], src[7 : 7 + (8 << 20)])
    assert not dst[:33].any() and not dst[33 + (8 << 20) :].any()


@needs_library
def test_the_last_small_run_is_copied_after_every_range(monkeypatch):
    """As with numpy tasks: a parallel native copy holds the plan's last run (a room's
    aux row) back until every thread's range has landed."""
    spans = []
    real = native_copy.Pieces.copy

    def timed(self, start=0, length=None):
        begin = time.perf_counter()
        done = real(self, start, length)
        time.sleep(0.002)
        spans.append((self.nbytes, begin, time.perf_counter()))
        return done

    monkeypatch.setattr(native_copy.Pieces, "copy", timed)
    n, page = 64, 4096
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 2 * n * page + 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_pages, dst_pages = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
    plan = TransferPlan(
        "p0",
        "d0",
        (
            _batch(src_pages * page, dst_pages * page, [page] * n, [1] * n),
            _batch([2 * n * page], [2 * n * page], [64], [1]),
        ),
    )
    CopyEngine(native=True, direct_max_runs=0, inline_nbytes=0, num_workers=2).execute(
        plan, {"s": src}, {"d": dst}
    )
    body = [span for span in spans if span[0] == n * page]
    ((_, tail_start, _),) = [span for span in spans if span[0] == 64]
    assert len(body) == 2 and tail_start >= max(end for _, _, end in body)
    assert np.array_equal(dst, _naive(plan, src, np.zeros_like(src)))


@needs_library
def test_a_one_page_room_copies_its_runs_in_one_call(monkeypatch):
    """The small-plan path (a few dozen runs, each checked in Python) hands them all to
    one native call; large enough, they are streamed."""
    calls = []
    real = native_copy.copy_list
    monkeypatch.setattr(native_copy, "copy_list", lambda runs: (calls.append(len(runs)), real(runs)))
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros(4 << 20, np.uint8)
    offsets = rng.permutation(64)[:64] * 32768
    batches = tuple(_batch([int(o)], [int(o) + 1], [32768 - 1], [1]) for o in offsets)
    plan = TransferPlan("p0", "d0", batches)
    assert CopyEngine(native=True).execute(plan, {"s": src}, {"d": dst}) == plan.total_nbytes
    assert calls == [3 * 64]  # one call, (dst, src, nbytes) per run
    assert np.array_equal(dst, _naive(plan, src, np.zeros_like(dst)))


def test_without_the_library_the_reason_names_the_build_command(tmp_path):
    lib, why = native_copy._load(tmp_path / "missing.so")
    assert lib is None and "python -m pd_transfer.transport.native.build" in why
    (tmp_path / "broken.so").write_bytes(b"not a library")
    lib, why = native_copy._load(tmp_path / "broken.so")
    assert lib is None and "does not load" in why


def test_turned_off_the_engine_copies_with_numpy_and_refuses_native():
    code = (
        "import numpy as np\n"
        "from pd_transfer.transport.copy import native_loop as native_copy\n"
        "from pd_transfer.transport.copy.copy_engine import CopyEngine\n"
        "from pd_transfer.layout.lowering import RunBatch, TransferPlan\n"
        "assert not native_copy.AVAILABLE, native_copy.UNAVAILABLE_WHY\n"
        "print(native_copy.UNAVAILABLE_WHY)\n"
        "a = np.arange(1 << 16, dtype=np.int64).view(np.uint8); b = np.zeros_like(a)\n"
        "i = lambda v: np.array(v, np.int64)\n"
        "plan = TransferPlan('p', 'd', (RunBatch('s', 'd', i([0, 4096]), i([8192, 0]), i([4096, 4096]),"
        " i([1, 1]), 0, 0),))\n"
        "engine = CopyEngine(direct_max_runs=0)\n"
        "assert not engine.native and engine.execute(plan, {'s': a}, {'d': b}) == 8192\n"
        "assert (b[8192:12288] == a[:4096]).all() and (b[:4096] == a[4096:8192]).all()\n"
        "try:\n    CopyEngine(native=True)\nexcept ValueError as err:\n    print(err)\n"
    )
    env = {**os.environ, "PD_TRANSFER_NATIVE_COPY": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "turned off by PD_TRANSFER_NATIVE_COPY",
        "the native copy loop is unavailable: turned off by PD_TRANSFER_NATIVE_COPY",
    ]


def test_the_loader_looks_for_what_the_build_makes():
    from pd_transfer.transport.native import build

    assert native_copy.LIBRARY_PATH == build.HERE / build.LIBRARY_NAME


@needs_library
def test_gather_and_scatter_runs_round_trip_and_refuse_a_short_buffer():
    rng = np.random.default_rng(5)
    region = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    offset = rng.permutation(1 << 10)[:300].astype(np.int64) * 1024 + 3
    nbytes = rng.integers(1, 1000, 300).astype(np.int64)
    packed = np.zeros(int(nbytes.sum()), np.uint8)
    native_copy.gather_runs(region, offset, nbytes, packed)
    assert np.array_equal(packed, np.concatenate([region[o : o + n] for o, n in zip(offset, nbytes)]))
    landed = np.zeros_like(region)
    native_copy.scatter_runs(landed, offset, nbytes, packed)
    for o, n in zip(offset, nbytes):
        assert np.array_equal(landed[o : o + n], region[o : o + n])
    assert int(np.count_nonzero(landed)) <= int(nbytes.sum())
    with pytest.raises(ValueError, match="do not fit"):
        native_copy.gather_runs(region, offset, nbytes, packed[:-1])
    with pytest.raises(ValueError, match="do not fit"):
        native_copy.scatter_runs(landed, offset, nbytes, packed[:-1])
    # runs past the region's end or before its start: refused, nothing written
    before = landed.copy()
    for bad in (offset + (1 << 20), offset - int(offset.min()) - 1):
        with pytest.raises(ValueError, match="outside the region"):
            native_copy.scatter_runs(landed, bad, nbytes, packed)
    assert np.array_equal(landed, before)


@pytest.mark.skipif(not shutil.which(os.environ.get("CC", "cc")), reason="no C compiler here")
def test_the_build_compiles_a_library_the_loader_accepts(tmp_path):
    from pd_transfer.transport.native import build

    library = build.build(tmp_path, quiet=True)
    assert library == tmp_path / build.LIBRARY_NAME
    lib, why = native_copy._load(library)
    assert lib is not None, why
    assert lib.pdt_abi() == native_copy.ABI


def test_a_failing_compiler_is_named_with_its_output(tmp_path, monkeypatch):
    from pd_transfer.transport.native import build

    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(RuntimeError, match="cannot run the C compiler '/nonexistent/cc'"):
        build.build(tmp_path, quiet=True)
    monkeypatch.setenv("CC", f"{sys.executable} -c 'import sys; sys.exit(\"broken compiler\")'")
    with pytest.raises(RuntimeError, match=r"(?s)failed \(1\):.*broken compiler"):
        build.build(tmp_path, quiet=True)
    assert not (tmp_path / build.LIBRARY_NAME).exists()
