"""Lowering block copies to strided descriptors and byte runs, vectorised.

A block copy is ``src_view[src_idx, ..., a:a+n, ...] -> dst_view[dst_idx, ...,
b:b+n, ...]``: the same logical sub-tensor at two strided places. Lowering:

1. Merge the innermost axes that are contiguous on *both* sides into one run
   of ``nbytes`` (start from one element; absorb an axis whose stride equals
   the run length on both sides; repeat).
2. The next axis (smallest destination stride) becomes the descriptor's
   ``count`` with its source and destination strides: one descriptor
   ``(src_offset, dst_offset, nbytes, count, src_stride, dst_stride)`` per
   remaining position. Engines that take strided descriptors use them as
   they are; :meth:`RunBatch.byte_runs` expands them to plain byte runs.
3. Enumerate the remaining axes and the index list with numpy broadcasting,
   never a Python loop per page or token.
4. Merge consecutive descriptors that continue each other on both sides
   (consecutive pages of a contiguous pool become one run).

Units (one tensor pair and one shard piece) with the same structure share one
computed pattern; each only adds its base offsets. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class RunBatch:
    """Descriptors from one source region to one destination region.

    Descriptor ``i`` copies ``count[i]`` pieces of ``nbytes[i]`` bytes; piece
    ``j`` goes from ``src_offset[i] + j * src_stride`` to ``dst_offset[i] + j *
    dst_stride``. Where ``count`` is 1 the strides are unused. Offsets are
    bytes from the start of the region.
    """

    src_region: str
    dst_region: str
    src_offset: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    src_stride: int
    dst_stride: int

    @property
    def num_descriptors(self) -> int:
        return len(self.src_offset)

    @property
    def num_runs(self) -> int:
        return int(self.count.sum())

    @property
    def total_nbytes(self) -> int:
        return int(np.dot(self.nbytes, self.count))

    def byte_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Plain ``(src_offset, dst_offset, nbytes)`` runs, one per piece."""
        if self.num_descriptors == 0 or int(self.count.max()) == 1:
            return self.src_offset, self.dst_offset, self.nbytes
        owner = np.repeat(np.arange(self.num_descriptors), self.count)
        first = np.cumsum(self.count) - self.count
        step = np.arange(len(owner), dtype=np.int64) - np.repeat(first, self.count)
        return (
            self.src_offset[owner] + step * self.src_stride,
            self.dst_offset[owner] + step * self.dst_stride,
            self.nbytes[owner],
        )


@dataclass(frozen=True)
class TransferPlan:
    """Everything one source rank writes into one destination rank."""

    src_rank: str
    dst_rank: str
    batches: tuple[RunBatch, ...]

    @cached_property
    def num_descriptors(self) -> int:
        return sum(b.num_descriptors for b in self.batches)

    @cached_property
    def num_runs(self) -> int:
        return sum(b.num_runs for b in self.batches)

    @cached_property
    def total_nbytes(self) -> int:
        return sum(b.total_nbytes for b in self.batches)

    def byte_runs(self) -> Iterator[tuple[str, str, np.ndarray, np.ndarray, np.ndarray]]:
        for batch in self.batches:
            yield (batch.src_region, batch.dst_region) + batch.byte_runs()

    def split_last(self, max_nbytes: int) -> tuple[TransferPlan, TransferPlan] | None:
        """``(this plan without its last descriptor, that descriptor alone)`` when that
        descriptor moves at most ``max_nbytes``, else None. A room's last chunk ends with
        its aux row; writers that move a plan in parallel move this part after the rest,
        so that it still lands last."""
        last = self.batches[-1] if self.batches else None
        if last is None or not len(last.src_offset):
            return None
        i = len(last.src_offset) - 1
        if int(last.nbytes[i]) * int(last.count[i]) > max_nbytes:
            return None

        def part(rows: slice) -> RunBatch:
            return RunBatch(
                last.src_region,
                last.dst_region,
                last.src_offset[rows],
                last.dst_offset[rows],
                last.nbytes[rows],
                last.count[rows],
                last.src_stride,
                last.dst_stride,
            )

        body = self.batches[:-1] + ((part(slice(0, i)),) if i else ())
        return (
            TransferPlan(self.src_rank, self.dst_rank, body),
            TransferPlan(self.src_rank, self.dst_rank, (part(slice(i, i + 1)),)),
        )


@dataclass(frozen=True)
class Unit:
    """One block copy, minus its index lists.

    ``axes`` holds ``(extent, src_stride, dst_stride)`` for every non-index
    axis; ``index_strides`` the index axis' strides on both sides.
    ``sub_strides`` is set for a token-paged pool whose page sizes differ:
    the unit then copies one granule of tokens (:mod:`.token_map`) and its
    items are ``(page, sub)`` pairs, at ``page * index_stride + sub *
    sub_stride`` on each side.
    """

    src_region: str
    dst_region: str
    src_base: int
    dst_base: int
    itemsize: int
    axes: tuple[tuple[int, int, int], ...]
    index_strides: tuple[int, int]
    pool: object
    layer: int | None = None  # the source tensor's layer id (None: not per layer)
    sub_strides: tuple[int, int] | None = None

    @property
    def signature(self) -> tuple:
        return (self.pool, self.itemsize, self.axes, self.index_strides, self.sub_strides)


@dataclass(frozen=True)
class _Pattern:
    rel_src: np.ndarray
    rel_dst: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    src_stride: int
    dst_stride: int


@dataclass(frozen=True)
class UnitGroup:
    """Units of one structure: one pattern serves all, each adds its base offsets."""

    units: tuple[Unit, ...]
    src_base: np.ndarray
    dst_base: np.ndarray

    @property
    def pool(self) -> object:
        return self.units[0].pool

    @cached_property
    def shape(self) -> _Shape:
        """What every unit's pattern shares, whatever the index lists."""
        return _shape(self.units[0])

    @cached_property
    def layers(self) -> np.ndarray:
        """Each unit's layer id (-1 where the tensor has none)."""
        return np.fromiter(
            (-1 if u.layer is None else u.layer for u in self.units), np.int64, len(self.units)
        )

    def only_layers(self, layers: np.ndarray) -> UnitGroup | None:
        """The units of ``layers`` only (None when there are none)."""
        keep = np.isin(self.layers, layers)
        if keep.all():
            return self
        if not keep.any():
            return None
        rows = np.flatnonzero(keep)
        part = UnitGroup(tuple(self.units[i] for i in rows), self.src_base[rows], self.dst_base[rows])
        part.__dict__["shape"] = self.shape  # same structure: reuse the computed part
        return part


def group_units(units: list[Unit]) -> list[UnitGroup]:
    by_signature: dict[tuple, list[Unit]] = {}
    for unit in units:
        by_signature.setdefault(unit.signature, []).append(unit)
    return [
        UnitGroup(
            tuple(group),
            np.fromiter((u.src_base for u in group), np.int64, len(group)),
            np.fromiter((u.dst_base for u in group), np.int64, len(group)),
        )
        for group in by_signature.values()
    ]


def lower(
    src_rank: str, dst_rank: str, units: list[Unit], indices: dict[object, tuple[np.ndarray, np.ndarray]]
) -> TransferPlan:
    """Lower ``units`` for the index lists of their pools into a plan."""
    return lower_groups(src_rank, dst_rank, group_units(units), indices)


_new = object.__new__


class GroupToLower(Protocol):
    """What :func:`lower_groups` reads of a group: a :class:`UnitGroup`, or one that
    ``grids.py`` keys by its grid's position instead of its pool."""

    @property
    def units(self) -> tuple[Unit, ...]: ...
    @property
    def src_base(self) -> np.ndarray: ...
    @property
    def dst_base(self) -> np.ndarray: ...
    @property
    def shape(self) -> _Shape: ...
    @property
    def pool(self) -> object: ...


def lower_groups(
    src_rank: str,
    dst_rank: str,
    groups: Sequence[GroupToLower],
    indices: Mapping[Any, tuple[np.ndarray, np.ndarray]],
) -> TransferPlan:
    batches: list[RunBatch] = []
    num_descriptors = num_runs = total_nbytes = 0
    for grouped in groups:
        group, src_base, dst_base = grouped.units, grouped.src_base, grouped.dst_base
        pattern = _pattern(grouped.shape, *indices[grouped.pool])
        src_offsets = src_base[:, None] + pattern.rel_src[None, :]
        dst_offsets = dst_base[:, None] + pattern.rel_dst[None, :]
        nbytes, count, src_stride, dst_stride = (
            pattern.nbytes,
            pattern.count,
            pattern.src_stride,
            pattern.dst_stride,
        )
        for unit, src_row, dst_row in zip(group, src_offsets, dst_offsets):
            batch = _new(RunBatch)  # the frozen __init__, without its eight object.__setattr__
            batch.__dict__.update(
                src_region=unit.src_region,
                dst_region=unit.dst_region,
                src_offset=src_row,
                dst_offset=dst_row,
                nbytes=nbytes,
                count=count,
                src_stride=src_stride,
                dst_stride=dst_stride,
            )
            batches.append(batch)
        # every batch of a group shares the pattern: its sums once, times the units
        num_descriptors += len(group) * len(pattern.nbytes)
        num_runs += len(group) * int(pattern.count.sum())
        total_nbytes += len(group) * int(np.dot(pattern.nbytes, pattern.count))
    plan = TransferPlan(src_rank, dst_rank, tuple(batches))
    # the cached properties, filled here (a 1-page room of 64 tensors: 64 batches to sum)
    plan.__dict__.update(num_descriptors=num_descriptors, num_runs=num_runs, total_nbytes=total_nbytes)
    return plan


@dataclass(frozen=True)
class _Shape:
    """The part of a unit's pattern that does not depend on the index lists: the run,
    the descriptor's count and strides, and every remaining axis enumerated as
    relative offsets (computed once per group, at the planner's start)."""

    run_nbytes: int
    count: int
    src_stride: int
    dst_stride: int
    combo_src: np.ndarray
    combo_dst: np.ndarray
    index_strides: tuple[int, int]
    sub_strides: tuple[int, int] | None = None


def _shape(unit: Unit) -> _Shape:
    run_nbytes = unit.itemsize
    rest = [a for a in unit.axes if a[0] > 1]
    merged = True
    while merged:  # absorb axes contiguous on both sides into the run
        merged = False
        for axis in rest:
            if axis[1] == run_nbytes and axis[2] == run_nbytes:
                run_nbytes *= axis[0]
                rest.remove(axis)
                merged = True
                break
    if rest:
        count_axis = min(rest, key=lambda a: (a[2], a[1]))
        rest.remove(count_axis)
        count, src_stride, dst_stride = count_axis
    else:
        count, src_stride, dst_stride = 1, run_nbytes, run_nbytes
    combo_src = np.zeros(1, np.int64)
    combo_dst = np.zeros(1, np.int64)
    for extent, s_stride, d_stride in sorted(rest, key=lambda a: -a[2]):
        steps = np.arange(extent, dtype=np.int64)
        combo_src = (combo_src[:, None] + steps * s_stride).ravel()
        combo_dst = (combo_dst[:, None] + steps * d_stride).ravel()
    return _Shape(
        run_nbytes, count, src_stride, dst_stride, combo_src, combo_dst, unit.index_strides, unit.sub_strides
    )


def _pattern(
    shape: _Shape,
    src_idx: np.ndarray,
    dst_idx: np.ndarray,
    src_sub: np.ndarray | None = None,
    dst_sub: np.ndarray | None = None,
) -> _Pattern:
    src_item = src_idx * shape.index_strides[0]
    dst_item = dst_idx * shape.index_strides[1]
    if shape.sub_strides is not None and src_sub is not None and dst_sub is not None:
        # a granule of tokens inside a page (page sizes differ, see token_map)
        src_item = src_item + src_sub * shape.sub_strides[0]
        dst_item = dst_item + dst_sub * shape.sub_strides[1]
    rel_src = src_item[:, None] + shape.combo_src[None, :]
    rel_dst = dst_item[:, None] + shape.combo_dst[None, :]
    return _merge(
        rel_src.ravel(), rel_dst.ravel(), shape.run_nbytes, shape.count, shape.src_stride, shape.dst_stride
    )


def _merge(
    rel_src: np.ndarray, rel_dst: np.ndarray, run_nbytes: int, count: int, src_stride: int, dst_stride: int
) -> _Pattern:
    """Join descriptors that continue each other on both sides."""
    n = len(rel_src)
    if n > 1:
        breaks = ((rel_src[1:] - rel_src[:-1]) != count * src_stride) | (
            (rel_dst[1:] - rel_dst[:-1]) != count * dst_stride
        )
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
    else:
        starts = np.arange(n)
    if len(starts) == n:
        counts = np.full(n, count, np.int64)
    else:
        counts = np.diff(np.append(starts, n)) * count
        rel_src, rel_dst = rel_src[starts], rel_dst[starts]
    if src_stride == run_nbytes and dst_stride == run_nbytes:
        # contiguous on both sides: a count of pieces is one longer run
        return _Pattern(
            rel_src, rel_dst, counts * run_nbytes, np.ones(len(counts), np.int64), run_nbytes, run_nbytes
        )
    return _Pattern(
        rel_src, rel_dst, np.full(len(counts), run_nbytes, np.int64), counts, src_stride, dst_stride
    )
