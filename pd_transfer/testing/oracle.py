"""Byte-exact comparison of a world's decode buffers with what a transfer owes.

Three rules, each reported as readable discrepancy lines:

1. every requested destination item of every decode view holds the logical
   tensor's requested source item, cut to the decode view's shard ranges;
2. every other byte of every decode region equals its snapshot from before
   the transfer (no stray writes, into padding, other pages or other pools);
3. every byte of every prefill region equals its snapshot (sources are read
   only).

Imports numpy and the layout description only; never the planner,
reconciliation, lowering or sharding modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pd_transfer.errors import PlanError, Reason
from pd_transfer.layout.views import Pool, TensorView
from pd_transfer.testing.logical import LogicalTensor
from pd_transfer.testing.placement import locate, window
from pd_transfer.testing.shards import shard_positions

MAX_LINES = 20


@dataclass
class Report:
    """Discrepancy lines, keeping the first ``max_lines`` and counting the rest."""

    max_lines: int = MAX_LINES
    total: int = 0
    shown: list[str] = field(default_factory=list)

    def add(self, line: str, count: int = 1) -> None:
        self.total += count
        if len(self.shown) < self.max_lines:
            self.shown.append(line)

    def lines(self) -> list[str]:
        if self.total > len(self.shown):
            return self.shown + [f"... {self.total} discrepancies in total, "
                                 f"first {len(self.shown)} shown"]
        return list(self.shown)


def normalise_requests(requests: dict) -> dict[Pool, tuple[np.ndarray, np.ndarray]]:
    """``Pool -> (src_indices, dst_indices)`` as int64 arrays; raises on a malformed request."""
    out = {}
    for pool, (src, dst) in requests.items():
        if not isinstance(pool, Pool):
            raise PlanError(f"request key {pool!r} is not a Pool", code=Reason.INDEX_OUT_OF_RANGE)
        src, dst = np.asarray(src), np.asarray(dst)
        if src.ndim != 1 or src.shape != dst.shape:
            raise PlanError(f"{pool.value}: {src.shape} source and {dst.shape} destination indices",
                            code=Reason.INDEX_COUNT_MISMATCH)
        if src.size and (src.dtype.kind not in "iu" or dst.dtype.kind not in "iu"):
            raise PlanError(f"{pool.value}: indices must be integers", code=Reason.INDEX_OUT_OF_RANGE)
        src, dst = src.astype(np.int64), dst.astype(np.int64)
        if np.unique(dst).size != dst.size:
            raise PlanError(f"{pool.value}: destination indices repeat, so what they should "
                            f"hold is ambiguous", code=Reason.INDEX_OUT_OF_RANGE)
        out[pool] = (src, dst)
    return out


def _check_range(rank_id: str, view: TensorView, side: str, indices: np.ndarray, count: int) -> None:
    bad = (indices < 0) | (indices >= count)
    if np.any(bad):
        raise PlanError(f"{rank_id} {view.path}: {side} index {int(indices[bad][0])} is outside "
                        f"0..{count - 1}", code=Reason.INDEX_OUT_OF_RANGE)


def compare_view(report: Report, rank_id: str, view: TensorView, order: tuple[int, ...],
                 logical: LogicalTensor, buf: np.ndarray,
                 src: np.ndarray, dst: np.ndarray) -> None:
    """Rule 1 for one decode view: one discrepancy per wrong destination item."""
    _check_range(rank_id, view, "source", src, logical.index_count)
    _check_range(rank_id, view, "destination", dst, view.index_count)
    if src.size == 0:
        return
    want = logical.slice_for(view, src)
    got = window(buf, view, order)[dst]
    diff = got != want
    wrong = np.flatnonzero(diff.reshape(src.size, -1).any(axis=1))
    index_name = view.axes[order[0]].name
    for i in wrong[: report.max_lines]:
        position = np.unravel_index(int(np.argmax(diff[i])), diff[i].shape)
        report.add(f"{rank_id} {view.path} {index_name} dst={int(dst[i])} src={int(src[i])}: "
                   f"{int(np.count_nonzero(diff[i]))}/{diff[i].size} bytes differ, first at "
                   f"{_describe(view, logical, position)}: "
                   f"got 0x{int(got[i][position]):02x} want 0x{int(want[i][position]):02x}")
    report.total += max(0, wrong.size - report.max_lines)


def _describe(view: TensorView, logical: LogicalTensor, position: tuple) -> str:
    """Logical coordinates of a byte of one item; the shard axis in global terms."""
    parts = []
    for axis, coord in enumerate(position[:-1], start=1):
        name = logical.axis_names[axis]
        if axis == logical.shard_axis:
            parts.append(f"{name}={int(shard_positions(view.shard)[coord])} (global)")
        else:
            parts.append(f"{name}={int(coord)}")
    parts.append(f"byte={int(position[-1])}")
    return " ".join(parts)


def mark_covered(mask: np.ndarray, view: TensorView, order: tuple[int, ...], dst: np.ndarray) -> None:
    """Mark the bytes of the requested destination items of ``view``."""
    if dst.size:
        window(mask, view, order)[dst] = True


def check_untouched(report: Report, rank_id: str, region_id: str, buf: np.ndarray,
                    snapshot: np.ndarray, covered: np.ndarray | None,
                    views: list[TensorView]) -> None:
    """Rules 2 and 3: bytes outside ``covered`` (all bytes when None) equal the snapshot."""
    changed = buf != snapshot
    if covered is not None:
        changed &= ~covered
    count = int(np.count_nonzero(changed))
    if count == 0:
        return
    first = int(np.argmax(changed))
    report.add(f"{rank_id} region {region_id!r}: {count} byte(s) changed that the transfer "
               f"must not touch, first at byte {first} ({locate(views, first)}): "
               f"got 0x{int(buf[first]):02x} was 0x{int(snapshot[first]):02x}")
