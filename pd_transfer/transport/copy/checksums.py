"""Per-block checksums of a planned transfer, computed the same way at both ends.

With integrity checking on (``integrity = true`` on both sidecars), decode
compares what a prefill rank sent with what its own memory holds once the
room has landed, block by block. A *block* is what one lowering unit (one
tensor pair and shard piece: decode's heads 0-3 of ``kv.k.L3`` from this
prefill rank) writes into one destination item (a page, state slot or aux
row). Its checksum is ``zlib.crc32`` of the block's bytes in destination
order:

- prefill reads them from its source regions at the runs' source offsets;
- decode reads them from its own regions at the runs' destination offsets.

Both rebuild the blocks from the pair's
:class:`~pd_transfer.layout.planner.PairPlanner` and the room's index lists,
so only the sums travel. A sliced TP 2 -> 4 head range is its own block: the
check covers exactly what this source wrote, not the whole destination page.

The block sums ``C[u, k]`` (unit ``u``, item position ``k``) of a pool travel
as n + m values instead of n * m::

    items[k]   = crc32(C[:, k] as little-endian uint32)     one per item position
    tensors[u] = crc32(C[u, :] as little-endian uint32)     one per unit, in position order

so chunks can be summed as they are sent (KV positions arrive in order). One
bad block changes exactly one item sum and one tensor sum, which together
name its page and its tensor. Units are ordered canonically (destination
region, offset), not in the planner's order.

Pure: numpy and zlib, no asyncio. Memory is read through :mod:`.regions`, so
CPU regions only.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import Unit, lower
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.views import Pool
from pd_transfer.transport.copy.runs import row_nbytes_for, rows_of
from pd_transfer.transport.regions import Mapped, Regions, map_regions

_GATHER_NBYTES = 32 << 20  # bytes gathered at once for blocks scattered over many runs
_ROW_CAP_NBYTES = 1 << 20
_ITEM_WORD = {Pool.KV: "page", Pool.SWA: "page", Pool.MAMBA: "slot", Pool.AUX: "row"}

IndexPair = tuple[np.ndarray, np.ndarray]


class CopySide(enum.Enum):
    """Which end of a copy a checksum reads."""

    SOURCE = "source"  # prefill: the bytes it sends
    DESTINATION = "destination"  # decode: the bytes that landed


@dataclass(frozen=True)
class _UnitRuns:
    """One unit's runs for one item, relative to ``base + index * index_stride``.

    In destination order; on each side, runs that continue each other there
    are joined (a sliced page is many source pieces but one destination run).
    """

    unit: Unit
    src_offset: np.ndarray
    src_nbytes: np.ndarray
    dst_offset: np.ndarray
    dst_nbytes: np.ndarray
    block_nbytes: int

    def side(self, side: CopySide) -> tuple[str, int, int, np.ndarray, np.ndarray]:
        unit = self.unit
        if side is CopySide.SOURCE:
            return (unit.src_region, unit.src_base, unit.index_strides[0], self.src_offset, self.src_nbytes)
        return (unit.dst_region, unit.dst_base, unit.index_strides[1], self.dst_offset, self.dst_nbytes)


def _join(offset: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(offset) <= 1:
        return offset, nbytes
    starts = np.flatnonzero(np.concatenate(([True], offset[1:] != offset[:-1] + nbytes[:-1])))
    return offset[starts], np.add.reduceat(nbytes, starts)


def _unit_runs(unit: Unit, like: _UnitRuns | None) -> _UnitRuns:
    if like is not None:  # same structure: same relative runs
        return _UnitRuns(
            unit, like.src_offset, like.src_nbytes, like.dst_offset, like.dst_nbytes, like.block_nbytes
        )
    zero = np.zeros(1, np.int64)
    plan = lower("src", "dst", [unit], {unit.pool: (zero, zero)})
    ((_, _, src, dst, nbytes),) = plan.byte_runs()  # one unit: one batch
    src, dst = src - unit.src_base, dst - unit.dst_base
    order = np.argsort(dst, kind="stable")
    src, dst, nbytes = src[order], dst[order], nbytes[order]
    return _UnitRuns(unit, *_join(src, nbytes), *_join(dst, nbytes), int(nbytes.sum()))


class BlockLayout:
    """The blocks of one (source rank, destination rank) pair, per pool."""

    def __init__(self, planner: PairPlanner) -> None:
        self.src_rank, self.dst_rank = planner.src.rank_id, planner.dst.rank_id
        self._units: dict[Pool, tuple[_UnitRuns, ...]] = {}
        for pool in Pool:
            runs: list[_UnitRuns] = []
            for group in planner.unit_groups(pool):
                first = None
                for unit in group.units:
                    first = _unit_runs(unit, first)
                    runs.append(first)
            runs.sort(key=lambda r: (r.unit.dst_region, r.unit.dst_base, r.unit.src_region, r.unit.src_base))
            if runs:
                self._units[pool] = tuple(runs)

    @property
    def pools(self) -> tuple[Pool, ...]:
        return tuple(self._units)

    def num_units(self, pool: Pool) -> int:
        return len(self._units.get(pool, ()))

    def block_sums(self, pool: Pool, indices: np.ndarray, regions: Regions, side: CopySide) -> np.ndarray:
        """``C[u, k]``: crc32 of unit ``u``'s block at ``indices[k]``, read on ``side``."""
        units = self._units.get(pool, ())
        idx = np.asarray(indices, np.int64).reshape(-1)
        out = np.zeros((len(units), len(idx)), np.uint32)
        if not len(idx) or not units:
            return out
        mapped = map_regions(regions, {r.side(side)[0] for r in units}, side.value)
        for row, runs in enumerate(units):
            region_id, base, stride, rel, nbytes = runs.side(side)
            starts = base + idx * stride
            _check_inside(mapped[region_id], starts, rel, nbytes, side)
            out[row] = _crc_blocks(mapped[region_id], starts, rel, nbytes, runs.block_nbytes)
        return out

    def block_runs(
        self, pool: Pool, unit: int, index: int, side: CopySide
    ) -> tuple[str, np.ndarray, np.ndarray]:
        """Region, offsets and lengths of unit ``unit``'s block at ``index`` on ``side``."""
        region_id, base, stride, rel, nbytes = self._units[pool][unit].side(side)
        return region_id, base + index * stride + rel, nbytes

    def describe(self, pool: Pool, unit: int, position: int, dst_indices: np.ndarray) -> str:
        """``kv page 17 (position 3) in region kv.k.L3 at offset 81920``."""
        index = int(dst_indices[position])
        region_id, offsets, _ = self.block_runs(pool, unit, index, CopySide.DESTINATION)
        return (
            f"{pool.value} {_ITEM_WORD.get(pool, 'item')} {index} (position {position}) in "
            f"region {region_id} at offset {int(offsets[0])}"
        )


def _check_inside(
    region: Mapped, starts: np.ndarray, rel: np.ndarray, nbytes: np.ndarray, side: CopySide
) -> None:
    low = int(starts.min()) + int(rel.min())
    high = int(starts.max()) + int((rel + nbytes).max())
    if low < 0 or high > region.nbytes:
        raise TransportError(
            f"checksum blocks [{low}, {high}) leave {side.value} region "
            f"{region.region_id!r} of {region.nbytes} bytes",
            code=Reason.RUN_OUT_OF_REGION,
        )


def _crc_blocks(
    region: Mapped, starts: np.ndarray, rel: np.ndarray, nbytes: np.ndarray, block_nbytes: int
) -> np.ndarray:
    if len(rel) == 1:  # one run per block: hash the memory in place
        view = region.array.data
        first, n = int(rel[0]), int(nbytes[0])
        return np.fromiter(
            (zlib.crc32(view[s : s + n]) for s in (starts + first).tolist()), np.uint32, len(starts)
        )
    out = np.empty(len(starts), np.uint32)
    per_batch = max(1, _GATHER_NBYTES // max(block_nbytes, 1))
    for a in range(0, len(starts), per_batch):
        part = starts[a : a + per_batch]
        offsets = (part[:, None] + rel[None, :]).ravel()
        lengths = np.tile(nbytes, len(part))
        row = row_nbytes_for(offsets, lengths, cap=_ROW_CAP_NBYTES)
        packed = np.take(region.void_rows(row), rows_of(offsets, lengths, row)).view(np.uint8).data
        out[a : a + len(part)] = [
            zlib.crc32(packed[j * block_nbytes : (j + 1) * block_nbytes]) for j in range(len(part))
        ]
    return out


def _crc_rows(sums: np.ndarray) -> np.ndarray:
    """crc32 of each row of a 2-D uint32 array, as little-endian bytes."""
    packed = np.ascontiguousarray(sums, dtype="<u4")
    width = packed.shape[1] * 4
    view = packed.view(np.uint8).reshape(-1).data
    return np.fromiter(
        (zlib.crc32(view[i * width : (i + 1) * width]) for i in range(len(packed))), np.uint32, len(packed)
    )


@dataclass
class PoolDigest:
    """One pool's summary: a sum per item position, one per unit (see the module docstring)."""

    items: np.ndarray
    tensors: np.ndarray
    filled: int = 0

    @classmethod
    def empty(cls, num_units: int, num_items: int) -> PoolDigest:
        return cls(np.zeros(num_items, np.uint32), np.zeros(num_units, np.uint32))

    def add(self, start: int, block_sums: np.ndarray) -> None:
        """Fold in ``C[:, start:start + k]``; positions must arrive in order."""
        count = block_sums.shape[1]
        if start != self.filled or start + count > len(self.items):
            raise ValueError(
                f"block sums for positions [{start}, {start + count}) after "
                f"{self.filled} of {len(self.items)}"
            )
        if count:
            self.items[start : start + count] = _crc_rows(block_sums.T)
            rows = np.ascontiguousarray(block_sums, dtype="<u4")
            self.tensors[:] = [zlib.crc32(rows[u].tobytes(), int(self.tensors[u])) for u in range(len(rows))]
        self.filled += count


class RoomDigest:
    """The digests of what one source sends to one destination rank, built chunk by chunk."""

    def __init__(self, layout: BlockLayout, item_counts: Mapping[Pool, int]) -> None:
        self.layout = layout
        self.pools = {
            pool: PoolDigest.empty(layout.num_units(pool), int(n))
            for pool, n in item_counts.items()
            if layout.num_units(pool)
        }

    def add_sent(
        self, requests: Mapping[Pool, IndexPair], starts: Mapping[Pool, int], regions: Regions
    ) -> None:
        """Hash one chunk's source bytes; ``starts`` gives each pool's first item position."""
        for pool, (src_idx, _) in requests.items():
            if pool in self.pools:
                sums = self.layout.block_sums(pool, src_idx, regions, CopySide.SOURCE)
                self.pools[pool].add(starts.get(pool, 0), sums)


def landed_digest(
    layout: BlockLayout, dst: Mapping[Pool, np.ndarray], regions: Regions
) -> dict[Pool, PoolDigest]:
    """Decode's side: the digests of what its regions hold for the room's indices."""
    out = {}
    for pool, idx in dst.items():
        if layout.num_units(pool):
            digest = PoolDigest.empty(layout.num_units(pool), len(idx))
            digest.add(0, layout.block_sums(pool, idx, regions, CopySide.DESTINATION))
            out[pool] = digest
    return out


def compare(
    layout: BlockLayout,
    dst: Mapping[Pool, np.ndarray],
    sent: Mapping[Pool, tuple[np.ndarray, np.ndarray]],
    landed: Mapping[Pool, PoolDigest],
) -> str:
    """'' when ``sent`` (items, tensors per pool) equals ``landed``; else what differs."""
    if set(sent) != set(landed):
        return (
            f"checksums cover pools {sorted(p.value for p in sent)}, expected "
            f"{sorted(p.value for p in landed)}"
        )
    problems = []
    for pool, digest in landed.items():
        items, tensors = (np.asarray(a, np.uint32) for a in sent[pool])
        if items.shape != digest.items.shape or tensors.shape != digest.tensors.shape:
            problems.append(
                f"{pool.value}: {len(items)} item and {len(tensors)} tensor "
                f"checksum(s), expected {len(digest.items)} and {len(digest.tensors)}"
            )
            continue
        bad_items = np.flatnonzero(items != digest.items)
        bad_units = np.flatnonzero(tensors != digest.tensors)
        if not len(bad_items) and not len(bad_units):
            continue
        where = layout.describe(
            pool,
            int(bad_units[0]) if len(bad_units) else 0,
            int(bad_items[0]) if len(bad_items) else 0,
            dst[pool],
        )
        word = _ITEM_WORD.get(pool, "item")
        problems.append(
            f"first bad block: {where}; {len(bad_items)} of {len(items)} {word}(s) "
            f"and {len(bad_units)} of {len(tensors)} tensor piece(s) differ"
        )
    return "; ".join(problems)
