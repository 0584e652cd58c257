"""POSIX shared-memory segments: plain files under ``/dev/shm``, mapped with mmap.

A worker allocates its pools here (:func:`create_segment`), publishes each
segment's name, and a sidecar on the same host maps it (:func:`open_segment`)
to read or write the bytes in place.

``multiprocessing.shared_memory`` is deliberately not used: its resource
tracker unlinks a segment when the process that *opened* it exits, pulling it
from under the processes still using it. Here only whoever calls
:meth:`Segment.unlink` removes a name, and a name is only ever taken from
:func:`segment_name` or checked by :func:`check_name`, so a peer cannot make
us open ``../etc/passwd``.

Views: :attr:`Segment.array` (numpy) and :attr:`Segment.tensor` (torch), both
uint8, 1-D, sharing the mapping. The tensor is built on the numpy array, not
with ``torch.frombuffer``: ``frombuffer`` holds no buffer export, so
``mmap.close()`` would succeed under it and the next access would fault. With
the array in between, a mapping stays alive as long as any view of it does.

A sidecar maps a segment whose pages all exist (the worker filled its
pools) with ``MAP_POPULATE``: its page tables are filled once, at
registration, instead of by a page fault on the first copy into or out of
each 4 KiB page (about 1,000 faults, 2-4 ms, for one 2 MiB page of Llama
KV). A sparse segment is mapped lazily: populating it would allocate all of
it, charged to the sidecar.

A segment mapped from another process (:func:`open_segment`) is watched for
SIGBUS (:mod:`pd_transfer.memory.segment_guard`): its owner can truncate it under the
mapping, and a copy into the lost part then fails the room
(:attr:`Segment.truncated`) instead of killing this process.

Imports numpy, and torch only when :attr:`Segment.tensor` is first asked for
(a sidecar copying between host pools never loads it); no asyncio, no zmq.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import stat
import weakref
from typing import TYPE_CHECKING

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.memory import segment_guard as shm_guard

if TYPE_CHECKING:
    import torch

SEGMENT_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdt-"
_MAX_NAME_LEN = 200
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_\-]+")


def segment_name(owner_id: str, region_id: str) -> str:
    """A safe, unique segment name for ``region_id`` of ``owner_id``.

    ``segment_name("prefill[pp0,tp1]", "kv.k.L3")`` ->
    ``"pdt-prefill-pp0-tp1-kv-k-L3-1f0c2a9b7d3e"``: readable parts with every
    unsafe character folded to ``-``, plus a hash of the exact strings, so two
    ids that fold alike ("a.b" and "a-b") still get different names.
    """
    digest = hashlib.blake2b(f"{owner_id}\0{region_id}".encode(), digest_size=6).hexdigest()
    owner = _UNSAFE_CHARS.sub("-", owner_id).strip("-")[:80]
    region = _UNSAFE_CHARS.sub("-", region_id).strip("-")[:80]
    return "-".join(part for part in (SEGMENT_PREFIX + owner, region, digest) if part)


def check_name(name: str) -> str:
    """Return ``name`` if it is a plain file name under /dev/shm, else raise."""
    if not isinstance(name, str) or not name:
        raise TransportError(
            f"segment name {name!r} is empty or not a string", code=Reason.SEGMENT_NAME_INVALID
        )
    if (
        "/" in name
        or ".." in name
        or name.startswith(".")
        or len(name) > _MAX_NAME_LEN
        or not _SAFE_NAME.fullmatch(name)
    ):
        raise TransportError(
            f"segment name {name!r} is refused: only letters, digits, '_', '-' and '.' "
            f"(no '/', no '..', no leading '.', at most {_MAX_NAME_LEN} characters)",
            code=Reason.SEGMENT_NAME_INVALID,
            hint="build names with pd_transfer.memory.segments.segment_name",
        )
    return name


class Segment:
    """One mapped segment. Use as a context manager or call :meth:`close`.

    ``owner`` is True for the creator; leaving the ``with`` block of an owned
    segment also unlinks its name (the mapping itself lives on in other
    processes that still hold it).
    """

    def __init__(
        self, name: str, mapping: mmap.mmap, nbytes: int, *, owner: bool, watched: bool = False
    ) -> None:
        self.name = name
        self.nbytes = nbytes
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping
        self._array: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
        self._tensor: torch.Tensor | None = None
        self._slot = -1
        self._fd = -1  # an unwatched segment opened from another process keeps its file
        self._unwatch: weakref.finalize | None = None
        if watched:  # the whole mapping, to its last page
            self._slot = shm_guard.watch(
                self._array.__array_interface__["data"][0], -(-len(mapping) // mmap.PAGESIZE) * mmap.PAGESIZE
            )
            # unwatched once, when the mapping really goes (close() may leave that to
            # the last view): a slot freed twice could be another segment's by then
            self._unwatch = weakref.finalize(mapping, shm_guard.unwatch, self._slot)

    @property
    def watched(self) -> bool:
        """Whether a SIGBUS in this mapping is caught (:mod:`pd_transfer.memory.segment_guard`)."""
        return self._slot >= 0 and self._unwatch is not None and self._unwatch.alive

    @property
    def truncated(self) -> bool:
        """The owner shrank the segment under this mapping and a copy touched the lost part:
        those pages are zeros now, never the owner's; the mapping must be dropped."""
        return self.watched and shm_guard.faults(self._slot) > 0

    @property
    def path(self) -> str:
        return os.path.join(SEGMENT_DIR, self.name)

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def array(self) -> np.ndarray:
        """The whole segment as a writable 1-D numpy uint8 array."""
        if self._array is None:
            raise TransportError(f"segment {self.name} is closed", code=Reason.LINK_CLOSED)
        return self._array

    @property
    def tensor(self) -> torch.Tensor:
        """The whole segment as a 1-D torch uint8 tensor (shares memory with :attr:`array`)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def shrunk(self) -> bool:
        """An unwatched segment's file is smaller than its mapping now (checked with fstat
        before a copy, where no SIGBUS guard is loaded; a truncation during the copy still
        faults). False for a watched segment: :attr:`truncated` says it."""
        if self._fd < 0:
            return False
        try:
            return os.fstat(self._fd).st_size < self.nbytes
        except OSError:
            return True

    def close(self) -> None:
        """Drop this object's views and unmap.

        A view handed out earlier keeps the mapping alive until it is itself
        released (the unmap then happens when the last view goes); accessing
        memory after close is never a fault.
        """
        self._array = None
        self._tensor = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                return  # a view is still exported; the mapping (and its watch) go with the last one
            if self._unwatch is not None:
                self._unwatch()

    def unlink(self) -> None:
        """Remove the name from /dev/shm (idempotent). Mappings stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Segment({self.name!r}, nbytes={self.nbytes}, {state})"


def create_segment(name: str, nbytes: int) -> Segment:
    """Create and map a new zero-filled segment; refuse if the name exists."""
    check_name(name)
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise TransportError(
            f"segment {name}: size must be a positive int, got {nbytes!r}", code=Reason.REGION_INVALID
        )
    path = os.path.join(SEGMENT_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise TransportError(
            f"segment {name} already exists in {SEGMENT_DIR}",
            code=Reason.SEGMENT_EXISTS,
            hint=f"another worker owns it, or a crashed one left it: remove {path} if no process uses it",
        ) from None
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return Segment(name, mapping, nbytes, owner=True)


def open_segment(name: str, min_nbytes: int = 1) -> Segment:
    """Map an existing segment created by another process.

    Refuses unsafe names, anything but a regular file, and a segment smaller
    than ``min_nbytes`` (the region size the peer registered): mapping a short
    file and writing past its end would be a SIGBUS, not an exception.
    """
    check_name(name)
    path = os.path.join(SEGMENT_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise TransportError(
            f"segment {name} does not exist in {SEGMENT_DIR}",
            code=Reason.SEGMENT_NOT_FOUND,
            hint="the owner has not created it yet, or has exited",
        ) from None
    except OSError as err:  # ELOOP for a symlink, EACCES, ...
        raise TransportError(
            f"segment {name} cannot be opened: {err.strerror}", code=Reason.SEGMENT_NOT_FOUND
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TransportError(f"segment {name} is not a regular file", code=Reason.SEGMENT_NAME_INVALID)
        if info.st_size < max(1, min_nbytes):
            raise TransportError(
                f"segment {name} holds {info.st_size} bytes but {min_nbytes} are needed",
                code=Reason.SEGMENT_TOO_SMALL,
                hint="the peer registered a region larger than the segment it published",
            )
        # fill the page tables now, only where the worker's pages all exist: populating a
        # sparse segment would allocate it, charged to this process
        populate = mmap.MAP_POPULATE if info.st_blocks * 512 >= info.st_size else 0
        mapping = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | populate)
    except BaseException:
        os.close(fd)
        raise
    segment = Segment(name, mapping, info.st_size, owner=False, watched=True)
    if segment.watched:
        os.close(fd)
    else:  # kept to check the size before each copy (Segment.shrunk): the next best thing
        segment._fd = fd
    return segment
