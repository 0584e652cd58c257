"""Lowering: descriptors describe exactly the element copies of the block, no more, no less."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_transfer.layout.lowering import Unit, lower
from pd_transfer.layout.views import Pool


def _naive_byte_pairs(unit: Unit, src_idx, dst_idx) -> np.ndarray:
    """Every (src byte, dst byte) pair, enumerated element by element."""
    pairs = []
    extents = [a[0] for a in unit.axes]
    for s_i, d_i in zip(src_idx, dst_idx):
        for pos in np.ndindex(*extents) if extents else [()]:
            src = unit.src_base + s_i * unit.index_strides[0]
            dst = unit.dst_base + d_i * unit.index_strides[1]
            for p, (_, ss, ds) in zip(pos, unit.axes):
                src += p * ss
                dst += p * ds
            for b in range(unit.itemsize):
                pairs.append((src + b, dst + b))
    return np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)


def _lowered_byte_pairs(unit: Unit, src_idx, dst_idx) -> np.ndarray:
    plan = lower("p", "d", [unit], {unit.pool: (np.asarray(src_idx), np.asarray(dst_idx))})
    pairs = []
    for _, _, src, dst, nbytes in plan.byte_runs():
        for s, d, n in zip(src, dst, nbytes):
            pairs += [(s + b, d + b) for b in range(n)]
    return np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)


def _contiguous_strides(extents, itemsize, order):
    strides = [0] * len(extents)
    step = itemsize
    for i in order:
        strides[i] = step
        step *= extents[i]
    return strides, step


@st.composite
def units(draw):
    n_axes = draw(st.integers(1, 4))
    extents = [draw(st.integers(1, 4)) for _ in range(n_axes)]
    itemsize = draw(st.sampled_from([1, 2, 4]))
    src_order = draw(st.permutations(range(n_axes)))
    dst_order = draw(st.permutations(range(n_axes)))
    src_strides, src_item = _contiguous_strides(extents, itemsize, src_order)
    dst_strides, dst_item = _contiguous_strides(extents, itemsize, dst_order)
    # padding makes an axis non-contiguous with its neighbour on one side only
    pad = draw(st.sampled_from([0, 0, itemsize, 3 * itemsize]))
    if pad and n_axes:
        src_strides = [s if s != max(src_strides) else s + pad for s in src_strides]
    axes = tuple(zip(extents, src_strides, dst_strides))
    src_index_stride = src_item + pad * extents[0] + draw(st.sampled_from([0, 64]))
    dst_index_stride = dst_item + draw(st.sampled_from([0, 16]))
    return Unit(
        "rs",
        "rd",
        draw(st.integers(0, 32)),
        draw(st.integers(0, 32)),
        itemsize,
        axes,
        (src_index_stride, dst_index_stride),
        Pool.KV,
    )


@settings(max_examples=150, deadline=None)
@given(unit=units(), data=st.data())
def test_lowering_moves_exactly_the_block_elements(unit, data):
    count = data.draw(st.integers(1, 6))
    src_idx = data.draw(st.lists(st.integers(0, 7), min_size=count, max_size=count, unique=True))
    dst_idx = data.draw(st.lists(st.integers(0, 7), min_size=count, max_size=count, unique=True))
    assert np.array_equal(
        _lowered_byte_pairs(unit, src_idx, dst_idx), _naive_byte_pairs(unit, src_idx, dst_idx)
    )


def test_lowering_coalesces_consecutive_contiguous_pages_into_one_run():
    page_nbytes = 16 * 8 * 128 * 2  # page of 16 tokens, 8 heads, head_dim 128, bf16
    axes = ((16, 8 * 128 * 2, 8 * 128 * 2), (8, 128 * 2, 128 * 2), (128, 2, 2))
    unit = Unit("a", "b", 0, 0, 2, axes, (page_nbytes, page_nbytes), Pool.KV)
    plan = lower("p", "d", [unit], {Pool.KV: (np.array([0, 1, 2, 7]), np.array([4, 5, 6, 0]))})
    (batch,) = plan.batches
    assert batch.src_offset.tolist() == [0, 7 * page_nbytes]
    assert batch.dst_offset.tolist() == [4 * page_nbytes, 0]
    assert batch.nbytes.tolist() == [3 * page_nbytes, page_nbytes]
    assert batch.count.tolist() == [1, 1]


def test_lowering_head_slice_becomes_one_strided_descriptor_per_page():
    # prefill tp=2 holds 4 heads, decode tp=8 one: 256 B per token, strided by 1024 B on the source
    src_axes_token, dst_axes_token = 4 * 256, 256
    axes = ((16, src_axes_token, dst_axes_token), (1, 256, 256), (128, 2, 2))
    unit = Unit("a", "b", 512, 0, 2, axes, (16 * 1024, 16 * 256), Pool.KV)
    plan = lower("p", "d", [unit], {Pool.KV: (np.array([3, 9]), np.array([0, 5]))})
    (batch,) = plan.batches
    assert batch.nbytes.tolist() == [256, 256]
    assert batch.count.tolist() == [16, 16]
    assert (batch.src_stride, batch.dst_stride) == (1024, 256)
    assert batch.src_offset.tolist() == [512 + 3 * 16 * 1024, 512 + 9 * 16 * 1024]
    assert plan.num_runs == 32


@settings(max_examples=60, deadline=None)
@given(first=units(), second=units(), data=st.data())
def test_a_plans_totals_equal_the_sums_over_its_batches(first, second, data):
    """The plan's counts are filled by the lowering from the shared patterns; they must
    equal what summing every batch gives (they size admission grants and metrics)."""
    count = data.draw(st.integers(1, 5))
    src_idx = np.array(data.draw(st.lists(st.integers(0, 7), min_size=count, max_size=count)))
    dst_idx = np.array(data.draw(st.lists(st.integers(0, 7), min_size=count, max_size=count, unique=True)))
    other = Unit("rs2", "rd2", 0, 0, first.itemsize, first.axes, first.index_strides, Pool.KV)
    plan = lower("p", "d", [first, other, second], {Pool.KV: (src_idx, dst_idx)})
    assert plan.num_descriptors == sum(len(b.src_offset) for b in plan.batches)
    assert plan.num_runs == sum(int(b.count.sum()) for b in plan.batches)
    assert plan.total_nbytes == sum(int((b.nbytes * b.count).sum()) for b in plan.batches)
