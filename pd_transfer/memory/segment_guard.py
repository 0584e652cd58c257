"""Surviving a segment truncated under its mapping: SIGBUS becomes an error on the room.

A sidecar maps segments other processes own: its worker's pools, a same-host
decode peer's pools. The owner (or a hostile peer holding the secret) can
``ftruncate`` one after it was mapped; the next load or store in the lost part
is a SIGBUS, which would kill the sidecar and every room it holds. A size check
before each copy cannot close that window (the truncation can land mid-copy),
so every segment a sidecar maps is *watched* instead: the native library's
SIGBUS handler (``transport/native/copy_runs.c``) replaces the lost part of a
watched mapping with zero pages, counts the fault on the segment, and lets the
faulting instruction run again, whichever code made it (the native copy loop,
numpy, torch). The data plane reads the counters around each write
(:func:`faults_total` is one memory read) and fails the write with
``segment_truncated`` naming the segment; the peer (or the worker) that owns
it is dropped.

Without the native library (no C compiler at install) nothing is watched:
:data:`AVAILABLE` is False and a truncated segment still faults, as the
startup log says.

Stdlib only (ctypes); loaded on the first :func:`watch`, so a worker process
that only creates segments never installs the handler.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

LIBRARY_PATH = Path(__file__).resolve().parents[1] / "transport" / "native" / "_copy_runs.so"
ABI = 5

_lib: ctypes.CDLL | None = None
_total: ctypes.c_int64 | None = None
_why_not = ""


def _load() -> ctypes.CDLL | None:
    global _lib, _total, _why_not
    if _lib is not None or _why_not:
        return _lib
    if not LIBRARY_PATH.exists():
        _why_not = f"{LIBRARY_PATH} is not built"
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY_PATH))
        if lib.pdt_abi() != ABI:
            _why_not = f"{LIBRARY_PATH} is ABI {lib.pdt_abi()}, this pd-transfer needs {ABI}"
            return None
        lib.pdt_guard_watch.restype = ctypes.c_int64
        lib.pdt_guard_watch.argtypes = [ctypes.c_int64, ctypes.c_int64]
        lib.pdt_guard_unwatch.restype = None
        lib.pdt_guard_unwatch.argtypes = [ctypes.c_int64]
        lib.pdt_guard_faults.restype = ctypes.c_int64
        lib.pdt_guard_faults.argtypes = [ctypes.c_int64]
        _total = ctypes.c_int64.in_dll(lib, "pdt_guard_faults_total")
    except (OSError, AttributeError) as err:
        _why_not = f"{LIBRARY_PATH} does not load: {err}"
        return None
    _lib = lib
    return lib


def available() -> bool:
    """Whether mapped segments can be watched (the native library loads)."""
    if os.environ.get("PD_TRANSFER_SIGBUS_GUARD", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _load() is not None


def why_unavailable() -> str:
    return "" if available() else (_why_not or "turned off by PD_TRANSFER_SIGBUS_GUARD")


def watch(address: int, nbytes: int) -> int:
    """Watch the mapping ``[address, address + nbytes)``: the slot, or -1 when not watched."""
    lib = _load() if available() else None
    if lib is None:
        return -1
    return int(lib.pdt_guard_watch(address, nbytes))


def unwatch(slot: int) -> None:
    if slot >= 0 and _lib is not None:
        _lib.pdt_guard_unwatch(slot)


def faults(slot: int) -> int:
    """SIGBUS faults absorbed in ``slot`` (0 for an unwatched one)."""
    return int(_lib.pdt_guard_faults(slot)) if slot >= 0 and _lib is not None else 0


def faults_total() -> int:
    """Faults absorbed in this process so far: compare before and after a copy."""
    return _total.value if _total is not None else 0


def check_landed(before: int, where: str) -> None:
    """Raise ``segment_truncated`` if a fault was absorbed since ``before`` (a
    :func:`faults_total`): what ``where`` wrote may have gone into zero pages."""
    if faults_total() != before:
        from pd_transfer.errors import Reason, TransportError

        raise TransportError(
            f"{where}: a segment of this sidecar's worker was truncated under "
            f"its mapping during the write; what it held is lost here",
            code=Reason.SEGMENT_TRUNCATED,
            hint="a worker must keep its pools' segments at their registered "
            "size; restart the worker and its sidecar",
        )
