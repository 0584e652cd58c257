"""Doorbells: a same-host room's end, seen by the decode worker without a message.

Over shm the prefill sidecar writes straight into the decode worker's pages;
telling the worker so took two more ZeroMQ hops (prefill -> decode sidecar ->
worker), about half of a 1-page room's time on a 2-core host. A doorbell
tells it through shared memory: the decode sidecar owns one segment of
64-byte slots, one armed per room, which the worker and the prefill
sidecars of that host map. A slot holds 32-bit words:

- ``bell``: a counter; everyone who changes the slot adds 1 to it and wakes
  the futex waiters on it, so a waiter that read it before the change never
  sleeps through the change;
- ``owner``: the token of the room the slot is armed for (tokens are unique
  per segment; a slot is reused only 4,095 rooms later);
- ``closed``: the decode sidecar's own verdict came first (the room failed,
  or succeeded over another transport): the worker must ask the sidecar;
- ``writers``: how many prefill ranks write this room (0 until known);
- one word per writer, which that writer sets to the token once all of its
  bytes for the room have landed.

Slot 0 is never armed: its ``bell`` moves with every other slot's, so that
one thread can sleep on all the rooms of a segment at once (the asyncio
client's watcher).

The room succeeded, as far as the doorbell tells, when every writer word
holds the token and ``closed`` does not: the worker reads the writer words
first and ``closed`` second, and the sidecar stores ``closed`` first and
reads the writer words second (after a barrier), so both reach the same
answer whichever comes first. A writer orders its data before its word with
an atomic operation in between (the kernel's, through ``FUTEX_WAKE_OP``,
which also drains the write-combining buffers that non-temporal copies fill).

Waiting is ``FUTEX_WAIT`` on the bell: the thread sleeps in the kernel, no
polling. Linux on x86-64 only (its stores are seen in order, which the read
orders above rely on); elsewhere :data:`AVAILABLE` is False and rooms end
through the sidecar's messages, as before.

Imports numpy, ctypes and :mod:`pd_transfer.memory.segments`; no asyncio, no zmq.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import platform
import secrets
import sys
import time

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.memory.segments import Segment, create_segment, open_segment, segment_name

SLOT_WORDS = 16  # 64 bytes a slot
MAX_WRITERS = SLOT_WORDS - 4  # prefill ranks writing one decode rank's room
DEFAULT_SLOTS = 4096
_BELL, _OWNER, _CLOSED, _WRITERS, _FIRST = 0, 1, 2, 3, 4
_TOKEN_MASK = 0xFFFF_FFFF
_DOORBELL_NAME = "-doorbells-"

# syscall(2) is variadic: every argument goes as a full 64-bit long
_SYS_FUTEX = ctypes.c_long(202)  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE_OP = ctypes.c_long(0), ctypes.c_long(5)
_WAKE_ALL = ctypes.c_long(0x7FFF_FFFF)
# FUTEX_WAKE_OP's operation: *uaddr2 += 1 (FUTEX_OP_ADD, oparg 1), and a comparison
# whose outcome does not matter (it wakes val2 = 0 more waiters either way)
_ADD_ONE = ctypes.c_long((1 << 28) | (1 << 12))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_syscall = _load_syscall()
AVAILABLE = _syscall is not None


class Outcome(enum.Enum):
    """How a :meth:`Doorbells.wait` ended."""

    RUNG = "rung"  # every writer's bytes landed: the room succeeded
    CLOSED = "closed"  # the sidecar decided first (or the slot moved on): ask it
    TIMEOUT = "timeout"  # nothing within the time given


class Doorbells:
    """One decode sidecar's doorbell segment, as its owner or as a peer maps it."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.words = (
            segment.array[: segment.array.size // (4 * SLOT_WORDS) * 4 * SLOT_WORDS]
            .view(np.uint32)
            .reshape(-1, SLOT_WORDS)
        )
        self.slots = len(self.words)
        self._base = self.words.__array_interface__["data"][0]
        self._next = secrets.randbelow(_TOKEN_MASK) + 1

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(cls, owner_id: str, slots: int = DEFAULT_SLOTS) -> Doorbells:
        """A new segment for ``owner_id`` (a decode sidecar); unlink it when done."""
        name = segment_name(owner_id, f"doorbells-{os.getpid()}-{secrets.token_hex(4)}")
        return cls(create_segment(name, max(2, slots) * SLOT_WORDS * 4))

    @classmethod
    def open(cls, name: str) -> Doorbells:
        """Map the segment a decode sidecar published.

        Refuses unsafe names and short files (:func:`~pd_transfer.memory.segments.open_segment`),
        and any name :meth:`create` would not have made: a peer must not get a
        pool segment of some worker of this host taken for its doorbells."""
        if not isinstance(name, str) or _DOORBELL_NAME not in name:
            raise TransportError(
                f"{name!r} is not the name of a doorbell segment (no {_DOORBELL_NAME!r} in it)",
                code=Reason.SEGMENT_NAME_INVALID,
            )
        return cls(open_segment(name, min_nbytes=2 * SLOT_WORDS * 4))

    def close(self) -> None:
        self.segment.close()

    # -- the decode sidecar ------------------------------------------------------------
    def arm(self) -> tuple[int, int]:
        """A fresh ``(slot, token)`` for a new room, its words cleared."""
        token = self._next
        self._next = token % _TOKEN_MASK + 1
        slot = 1 + token % (self.slots - 1)  # slot 0: the segment's own bell
        words = self.words[slot]
        words[_OWNER] = 0  # a writer still ringing an older room finds no owner
        words[_CLOSED:] = 0
        words[_OWNER] = token
        self._bump(slot)  # a waiter of the slot's older room wakes and looks
        return slot, token

    def set_writers(self, slot: int, token: int, count: int) -> None:
        """The room's writers are known: ``count`` prefill ranks (1 .. MAX_WRITERS)."""
        if self.words[slot, _OWNER] == token:
            self.words[slot, _WRITERS] = count
            self._bump(slot)

    def close_slot(self, slot: int, token: int) -> bool:
        """The sidecar decides the room: mark the slot closed and wake its waiters.

        Returns True when every writer had rung first: the room then succeeded
        (the worker may already have returned that), whatever the sidecar
        was about to decide."""
        if self.words[slot, _OWNER] != token:
            return False
        self.words[slot, _CLOSED] = token
        self._bump(slot)  # an atomic add: the store above is seen before the reads below
        return self.rung(slot, token)

    def rung(self, slot: int, token: int) -> bool:
        """Every writer of the room has rung (its bytes landed)."""
        words = self.words[slot]
        count = int(words[_WRITERS])
        return (
            int(words[_OWNER]) == token
            and 0 < count <= MAX_WRITERS
            and bool((words[_FIRST : _FIRST + count] == token).all())
        )

    # -- a prefill sidecar ---------------------------------------------------------------
    def ring(self, slot: int, token: int, writer: int) -> bool:
        """Writer ``writer``'s bytes of the room armed as ``(slot, token)`` have landed.

        False (nothing written) when the slot is out of range or no longer
        armed for ``token``; the decode sidecar's Done path then ends the room."""
        if (
            not (0 < slot < self.slots and 0 <= writer < MAX_WRITERS and token > 0)
            or int(self.words[slot, _OWNER]) != token
        ):
            return False
        self._bump(slot, everyone=False)  # a barrier: the room's bytes before the word below
        self.words[slot, _FIRST + writer] = token
        self._bump(slot)
        return True

    # -- the decode worker ---------------------------------------------------------------
    def wait(self, slot: int, token: int, timeout_s: float) -> Outcome:
        """Sleep until the room armed as ``(slot, token)`` is rung or closed, at most ``timeout_s``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            bell = self.bell(slot)
            outcome = self.peek(slot, token)
            if outcome is not None:
                return outcome
            left = deadline - time.monotonic()
            if left <= 0:
                return Outcome.TIMEOUT
            self.sleep(slot, bell, left)

    def peek(self, slot: int, token: int) -> Outcome | None:
        """RUNG or CLOSED as :meth:`wait` would return them, or None (not yet); no sleep."""
        words = self.words[slot]
        if int(words[_OWNER]) != token:
            return Outcome.CLOSED
        if self.rung(slot, token) and int(words[_CLOSED]) != token:  # writers first, then closed
            return Outcome.RUNG
        return Outcome.CLOSED if int(words[_CLOSED]) == token else None

    def bell(self, slot: int = 0) -> int:
        """The bell counter of ``slot`` (0: the whole segment's); read it before looking."""
        return int(self.words[slot, _BELL])

    def sleep(self, slot: int, bell: int, timeout_s: float) -> None:
        """Sleep until ``slot``'s bell (0: any) moves on from ``bell``, at most ``timeout_s``."""
        address = ctypes.c_void_p(self._base + slot * SLOT_WORDS * 4)
        spec = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        if (
            _syscall(
                _SYS_FUTEX,
                address,
                _FUTEX_WAIT,
                ctypes.c_long(bell),
                ctypes.byref(spec),
                None,
                ctypes.c_long(0),
            )
            < 0
        ):
            code = ctypes.get_errno()
            if code not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
                raise OSError(code, os.strerror(code))

    def interrupt(self, slot: int) -> None:
        """Wake every waiter of ``slot`` (0: of the segment), changing nothing else."""
        self._bump(slot)

    def _bump(self, slot: int, *, everyone: bool = True) -> None:
        for target in (slot, 0) if everyone and slot else (slot,):
            address = ctypes.c_void_p(self._base + target * SLOT_WORDS * 4)
            if _syscall(_SYS_FUTEX, address, _FUTEX_WAKE_OP, _WAKE_ALL, None, address, _ADD_ONE) < 0:
                code = ctypes.get_errno()
                raise OSError(code, f"futex wake: {os.strerror(code)}")


__all__ = ["AVAILABLE", "DEFAULT_SLOTS", "MAX_WRITERS", "Doorbells", "Outcome"]
