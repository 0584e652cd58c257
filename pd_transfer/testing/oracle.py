"""Byte-exact comparison of a world's decode buffers with what a transfer owes.

Three rules, each reported as readable discrepancy lines:

1. every requested destination item of every decode view holds the logical
   tensor's requested source item, cut to the decode view's shard ranges;
2. every other byte of every decode region equals its snapshot from before
   the transfer (no stray writes, into padding, other pages or other pools);
3. every byte of every prefill region equals its snapshot (sources are read
   only).

Token-paged views (KV, SWA) whose page size differs from the prefill
tensor's, or whose request is a :class:`~pd_transfer.layout.spans.TokenSpan`,
are owed token by token: every request token that both page lists hold, found
by intersecting the two lists' token numbers (:func:`owed_tokens`).

Imports numpy and the layout description only; never the planner,
reconciliation, lowering, sharding or token mapping modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pd_transfer.errors import PlanError, Reason
from pd_transfer.layout.spans import TokenSpan
from pd_transfer.layout.views import AxisRole, Pool, TensorView
from pd_transfer.testing.logical import LogicalTensor
from pd_transfer.testing.placement import locate, window
from pd_transfer.testing.shards import shard_positions, view_shard

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
            return self.shown + [f"... {self.total} discrepancies in total, first {len(self.shown)} shown"]
        return list(self.shown)


@dataclass(frozen=True)
class Owed:
    """One pool's request as the oracle reads it: index lists and, for token-paged
    pools, the request token each list starts at (0 for a plain pair)."""

    src: np.ndarray
    dst: np.ndarray
    src_first_token: int = 0
    dst_first_token: int = 0
    is_span: bool = False


def normalise_requests(requests: dict) -> dict[Pool, Owed]:
    """``Pool -> Owed`` with int64 index arrays; raises on a malformed request."""
    out = {}
    for pool, request in requests.items():
        if not isinstance(pool, Pool):
            raise PlanError(f"request key {pool!r} is not a Pool", code=Reason.INDEX_OUT_OF_RANGE)
        if isinstance(request, TokenSpan):
            src, dst = np.asarray(request.src_pages), np.asarray(request.dst_pages)
            firsts = (int(request.src_first_token), int(request.dst_first_token))
        else:
            src, dst = np.asarray(request[0]), np.asarray(request[1])
            firsts = None
        if src.ndim != 1 or dst.ndim != 1:
            raise PlanError(
                f"{pool.value}: {src.shape} source and {dst.shape} destination indices",
                code=Reason.INDEX_COUNT_MISMATCH,
            )
        if src.size and (src.dtype.kind not in "iu" or dst.dtype.kind not in "iu"):
            raise PlanError(f"{pool.value}: indices must be integers", code=Reason.INDEX_OUT_OF_RANGE)
        src, dst = src.astype(np.int64).reshape(-1), dst.astype(np.int64).reshape(-1)
        if np.unique(dst).size != dst.size:
            raise PlanError(
                f"{pool.value}: destination indices repeat, so what they should hold is ambiguous",
                code=Reason.INDEX_OUT_OF_RANGE,
            )
        out[pool] = Owed(src, dst, *(firsts or (0, 0)), is_span=firsts is not None)
    return out


def is_token_paged(view: TensorView, logical: LogicalTensor, owed: Owed) -> bool:
    """Whether ``view`` is owed token by token (page sizes differ, or a span was given)."""
    token = view.axis_index(AxisRole.TOKEN)
    if token is None or view.pool not in (Pool.KV, Pool.SWA):
        return False
    return owed.is_span or view.shape[token] != logical.page_size(view)


def owed_tokens(
    owed: Owed, src_page_size: int, dst_page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(src_page, src_slot, dst_page, dst_slot)`` of every request token both lists hold."""
    src_tokens = owed.src_first_token + np.arange(owed.src.size * src_page_size)
    dst_tokens = owed.dst_first_token + np.arange(owed.dst.size * dst_page_size)
    common = np.intersect1d(src_tokens, dst_tokens)
    src_at = common - owed.src_first_token
    dst_at = common - owed.dst_first_token
    return (
        owed.src[src_at // src_page_size],
        src_at % src_page_size,
        owed.dst[dst_at // dst_page_size],
        dst_at % dst_page_size,
    )


def compare_tokens(
    report: Report,
    rank_id: str,
    view: TensorView,
    order: tuple[int, ...],
    logical: LogicalTensor,
    buf: np.ndarray,
    owed: Owed,
) -> None:
    """Rule 1 for a token-owed decode view: one discrepancy per wrong destination token."""
    _check_range(rank_id, view, "source", owed.src, logical.index_count)
    _check_range(rank_id, view, "destination", owed.dst, view.index_count)
    token_axis = logical.token_axis(view)
    src_page, src_slot, dst_page, dst_slot = owed_tokens(
        owed, logical.page_size(view), view.shape[view.axis_of(AxisRole.TOKEN)]
    )
    if src_page.size == 0:
        return
    want = np.moveaxis(logical.slice_for(view), token_axis, 1)[src_page, src_slot]
    got = np.moveaxis(window(buf, view, order), token_axis, 1)[dst_page, dst_slot]
    wrong = np.flatnonzero((got != want).reshape(src_page.size, -1).any(axis=1))
    for i in wrong[: report.max_lines]:
        report.add(
            f"{rank_id} {view.path} token page dst={int(dst_page[i])} "
            f"slot={int(dst_slot[i])} src={int(src_page[i])} slot={int(src_slot[i])}: "
            f"{int(np.count_nonzero(got[i] != want[i]))}/{got[i].size} bytes differ"
        )
    report.total += max(0, wrong.size - report.max_lines)


def mark_tokens(
    mask: np.ndarray, view: TensorView, order: tuple[int, ...], logical: LogicalTensor, owed: Owed
) -> None:
    """Mark the bytes of the owed destination tokens of ``view``."""
    _, _, dst_page, dst_slot = owed_tokens(
        owed, logical.page_size(view), view.shape[view.axis_of(AxisRole.TOKEN)]
    )
    if dst_page.size:
        np.moveaxis(window(mask, view, order), logical.token_axis(view), 1)[dst_page, dst_slot] = True


def _check_range(rank_id: str, view: TensorView, side: str, indices: np.ndarray, count: int) -> None:
    bad = (indices < 0) | (indices >= count)
    if np.any(bad):
        raise PlanError(
            f"{rank_id} {view.path}: {side} index {int(indices[bad][0])} is outside 0..{count - 1}",
            code=Reason.INDEX_OUT_OF_RANGE,
        )


def compare_view(
    report: Report,
    rank_id: str,
    view: TensorView,
    order: tuple[int, ...],
    logical: LogicalTensor,
    buf: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
) -> None:
    """Rule 1 for one decode view: one discrepancy per wrong destination item."""
    if src.shape != dst.shape:
        raise PlanError(
            f"{view.pool.value}: {src.shape} source and {dst.shape} destination indices",
            code=Reason.INDEX_COUNT_MISMATCH,
        )
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
        report.add(
            f"{rank_id} {view.path} {index_name} dst={int(dst[i])} src={int(src[i])}: "
            f"{int(np.count_nonzero(diff[i]))}/{diff[i].size} bytes differ, first at "
            f"{_describe(view, logical, position)}: "
            f"got 0x{int(got[i][position]):02x} want 0x{int(want[i][position]):02x}"
        )
    report.total += max(0, wrong.size - report.max_lines)


def _describe(view: TensorView, logical: LogicalTensor, position: tuple) -> str:
    """Logical coordinates of a byte of one item; the shard axis in global terms."""
    parts = []
    for axis, coord in enumerate(position[:-1], start=1):
        name = logical.axis_names[axis]
        if axis == logical.shard_axis:
            parts.append(f"{name}={int(shard_positions(view_shard(view))[coord])} (global)")
        else:
            parts.append(f"{name}={int(coord)}")
    parts.append(f"byte={int(position[-1])}")
    return " ".join(parts)


def mark_covered(mask: np.ndarray, view: TensorView, order: tuple[int, ...], dst: np.ndarray) -> None:
    """Mark the bytes of the requested destination items of ``view``."""
    if dst.size:
        window(mask, view, order)[dst] = True


def check_untouched(
    report: Report,
    rank_id: str,
    region_id: str,
    buf: np.ndarray,
    snapshot: np.ndarray,
    covered: np.ndarray | None,
    views: list[TensorView],
) -> None:
    """Rules 2 and 3: bytes outside ``covered`` (all bytes when None) equal the snapshot."""
    changed = buf != snapshot
    if covered is not None:
        changed &= ~covered
    count = int(np.count_nonzero(changed))
    if count == 0:
        return
    first = int(np.argmax(changed))
    report.add(
        f"{rank_id} region {region_id!r}: {count} byte(s) changed that the transfer "
        f"must not touch, first at byte {first} ({locate(views, first)}): "
        f"got 0x{int(buf[first]):02x} was 0x{int(snapshot[first]):02x}"
    )
