"""Which chunks a tcp receiver may write: expected rooms, their pages, and fences.

The decode side tells its receiver what it expects before it asks prefill
for a room: ``expect(room, generation, ranges)``, where ``ranges`` are the
byte ranges of that room's destination pages and slots in each region
(:func:`item_ranges` computes them from the rank's views). A chunk is
written only if

- its room generation is not fenced (an aborted room: STALE_GENERATION),
- under :attr:`RoomPolicy.EXPECTED`, its room is expected (UNKNOWN_ROOM) with
  exactly that generation (STALE_GENERATION below it, BAD_GENERATION above),
- every run lies inside the room's ranges (RUN_OUT_OF_REGION), when the room
  is expected (under :attr:`RoomPolicy.ANY`, for tests and benchmarks, a room
  nobody announced is bounds-checked against its regions only).

:meth:`ReceiverRooms.admit` checks and registers the chunk as landing in one
step under a lock, and :meth:`ReceiverRooms.fence` drops the room's
expectation under that same lock: a chunk admitted before the fence is
waited for (:meth:`wait_idle`), one arriving after it is refused. So once a
fence returns no chunk of the fenced generation can land.

Thread-safe: the receiver's connection threads admit and release, the event
loop expects, forgets and fences. Imports numpy and the layout's views only.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.views import AxisRole, Pool, TensorView

_MAX_EXPECTED = 65536
_MAX_FENCES = 65536


class RoomPolicy(enum.Enum):
    EXPECTED = "expected"  # only rooms announced with expect(), only into their ranges
    ANY = "any"  # any room not fenced (standalone receivers in tests, benchmarks)


@dataclass(frozen=True)
class ByteRanges:
    """Sorted, disjoint, non-touching ``[starts[i], ends[i])`` byte ranges of one region."""

    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def merged(cls, starts: np.ndarray, ends: np.ndarray) -> ByteRanges:
        """Ranges in any order, overlapping or touching, joined into the fewest ranges."""
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        if len(starts) == 0:
            return cls(starts, ends)
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], np.maximum.accumulate(ends[order])
        # a range starts a new group unless it begins at or before the running end before it
        new = np.concatenate(([True], starts[1:] > ends[:-1]))
        first = np.flatnonzero(new)
        last = np.concatenate((first[1:] - 1, [len(starts) - 1]))
        return cls(starts[first], ends[last])

    def __len__(self) -> int:
        return len(self.starts)

    def covers(self, offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Per run: does ``[offset, offset + nbytes)`` lie inside one of the ranges?"""
        at = np.searchsorted(self.starts, offset, side="right") - 1
        inside = at >= 0
        end = self.ends[np.maximum(at, 0)] if len(self.ends) else np.zeros_like(offset)
        return inside & (nbytes <= end - offset)


@dataclass(frozen=True)
class Ticket:
    """One admitted chunk, landing until :meth:`ReceiverRooms.release`."""

    room: str
    generation: int


@dataclass(frozen=True)
class _Expected:
    generation: int
    ranges: Mapping[str, ByteRanges]


class ReceiverRooms:
    """The receiver's room table: expectations, fences and chunks landing."""

    def __init__(self, policy: RoomPolicy = RoomPolicy.ANY) -> None:
        self.policy = policy
        self._lock = threading.Condition()
        self._expected: OrderedDict[str, _Expected] = OrderedDict()
        self._fences: OrderedDict[str, int] = OrderedDict()
        self._landing: Counter[tuple[str, int]] = Counter()

    # -- the decode side's calls -----------------------------------------------------
    def expect(self, room: str, generation: int, ranges: Mapping[str, ByteRanges]) -> None:
        """Accept chunks of ``room`` at ``generation``, only inside ``ranges``."""
        with self._lock:
            self._expected.pop(room, None)
            self._expected[room] = _Expected(generation, dict(ranges))
            while len(self._expected) > _MAX_EXPECTED:  # never forgotten: oldest refused first
                self._expected.popitem(last=False)

    def forget(self, room: str) -> None:
        """The room is finished: refuse its later chunks (it is no longer expected)."""
        with self._lock:
            self._expected.pop(room, None)

    def fence(self, room: str, generation: int) -> None:
        """Refuse every later chunk of ``room`` up to ``generation``; see :meth:`wait_idle`."""
        with self._lock:
            self._fences[room] = max(generation, self._fences.pop(room, -1))
            while len(self._fences) > _MAX_FENCES:  # rooms the agent never forgot: oldest first
                self._fences.popitem(last=False)
            expected = self._expected.get(room)
            if expected is not None and expected.generation <= generation:
                del self._expected[room]

    def forget_room(self, room: str) -> None:
        """Drop everything known about a room that is finished for good."""
        with self._lock:
            self._fences.pop(room, None)
            self._expected.pop(room, None)

    # -- the receiver's calls ---------------------------------------------------------
    def check_fence(self, room: str, generation: int) -> None:
        with self._lock:
            self._check_fence(room, generation)

    def check_end(self, room: str, generation: int) -> None:
        """A transfer's end: the room must still be admitted (it writes nothing itself)."""
        with self._lock:
            self._check_room(room, generation)

    def admit(self, room: str, generation: int, region_ids: tuple[str, ...], runs: np.ndarray) -> Ticket:
        """Check a chunk (its runs already inside their regions) and mark it landing.

        ``runs`` rows are ``(region slot, offset, nbytes)`` into ``region_ids``.
        """
        with self._lock:
            expected = self._check_room(room, generation)
            if expected is not None:
                _check_ranges(room, region_ids, runs, expected.ranges)
            ticket = Ticket(room, generation)
            self._landing[(room, generation)] += 1
            return ticket

    def release(self, ticket: Ticket) -> None:
        with self._lock:
            key = (ticket.room, ticket.generation)
            self._landing[key] -= 1
            if self._landing[key] <= 0:
                del self._landing[key]
            self._lock.notify_all()

    def busy(self, room: str, generation: int) -> bool:
        """Is a chunk of ``room`` at or below ``generation`` still landing?"""
        with self._lock:
            return self._busy(room, generation)

    def wait_idle(self, room: str, generation: int, timeout_s: float | None = None) -> bool:
        """Block until no chunk of ``room`` up to ``generation`` is landing; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._busy(room, generation):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def _busy(self, room: str, generation: int) -> bool:
        return any(r == room and g <= generation for r, g in self._landing)

    def _check_room(self, room: str, generation: int) -> _Expected | None:
        self._check_fence(room, generation)
        expected = self._expected.get(room)
        if expected is None:
            if self.policy is RoomPolicy.EXPECTED:
                raise TransportError(
                    f"room {room} is not expected by this decode rank: nothing was written",
                    code=Reason.UNKNOWN_ROOM,
                )
            return None
        if generation != expected.generation:
            code = Reason.STALE_GENERATION if generation < expected.generation else Reason.BAD_GENERATION
            raise TransportError(
                f"room {room} generation {generation} is not the expected generation {expected.generation}",
                code=code,
            )
        return expected

    def _check_fence(self, room: str, generation: int) -> None:
        fence = self._fences.get(room)
        if fence is not None and generation <= fence:
            raise TransportError(
                f"room {room} generation {generation} was aborted (fenced at {fence})",
                code=Reason.STALE_GENERATION,
            )


def _check_ranges(
    room: str, region_ids: tuple[str, ...], runs: np.ndarray, ranges: Mapping[str, ByteRanges]
) -> None:
    if not len(runs):
        return
    slots = runs[:, 0]
    for slot in np.unique(slots).tolist():
        region_id = region_ids[slot]
        mine = runs[slots == slot] if len(region_ids) > 1 else runs
        allowed = ranges.get(region_id)
        ok = (
            allowed.covers(mine[:, 1], mine[:, 2])
            if allowed is not None and len(allowed)
            else np.zeros(len(mine), bool)
        )
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise TransportError(
                f"room {room}: {int(mine[i, 2])} bytes at offset {int(mine[i, 1])} of region "
                f"{region_id!r} are outside the pages this room expects "
                f"({int((~ok).sum())} such run(s)); nothing was written",
                code=Reason.RUN_OUT_OF_REGION,
            )


def item_ranges(
    views: Iterable[TensorView], indices: Mapping[Pool, Iterable[int] | np.ndarray]
) -> dict[str, ByteRanges]:
    """The byte ranges of the items ``indices[view.pool]`` of every view, per region.

    Each item (a page, a slot, a row) counts as the span from its first to its
    last byte: exact for items that are contiguous (NHD, HND, layer_first),
    and for page_head (one layer's bytes of a page interleave with the other
    layers' bytes of the same page) it also admits those, which belong to the
    same page. Indices outside a view's index axis are ignored.
    """
    starts: dict[str, list[np.ndarray]] = {}
    ends: dict[str, list[np.ndarray]] = {}
    arrays = {
        pool: np.asarray(list(idx) if not isinstance(idx, np.ndarray) else idx, np.int64)
        for pool, idx in indices.items()
    }
    for view in views:
        idx = arrays.get(view.pool)
        if idx is None or not len(idx):
            continue
        axis = view.axis_of(AxisRole.INDEX)
        idx = idx[(idx >= 0) & (idx < view.shape[axis])]
        extent = view.itemsize + sum(
            (n - 1) * s for j, (n, s) in enumerate(zip(view.shape, view.strides_nbytes)) if j != axis
        )
        first = view.offset_nbytes + idx * view.strides_nbytes[axis]
        starts.setdefault(view.region, []).append(first)
        ends.setdefault(view.region, []).append(first + extent)
    return {
        region: ByteRanges.merged(np.concatenate(starts[region]), np.concatenate(ends[region]))
        for region in starts
    }
