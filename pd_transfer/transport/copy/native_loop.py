"""Copying a checked plan with the native copy loop (``native/copy_runs.c``).

One ctypes call copies every piece of a byte range of the plan; the engine's
threads each take a range (ctypes releases the GIL for the call). Pieces of
``STREAM_MIN_NBYTES`` or more are written with non-temporal stores where the
CPU has them, which skips reading each destination line before writing it:
scattered 16 KiB pages then move at about the speed of one contiguous copy
(1.2-1.3x what the numpy tasks or a memcpy loop reach on this 2-core host),
2 KiB head slices at about twice numpy's rate (see docs/performance.md).

:data:`AVAILABLE` is False, with the reason in :data:`UNAVAILABLE_WHY`, when
the library was not built (no C compiler at install time), does not load, or
``PD_TRANSFER_NATIVE_COPY=0`` turns it off; the engine then compiles numpy
tasks instead (:mod:`~pd_transfer.transport.copy.tasks`).

Safety: every address is a mapped region's base plus an offset that
:func:`~pd_transfer.transport.copy.bounds.check_bounds` accepted; the caller keeps the regions mapped for
the call.
"""

from __future__ import annotations

import ctypes
import os
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.runs import Flat
from pd_transfer.transport.regions import Mapped

ABI = 5  # pdt_abi() of the library this module calls (copy_runs.c's PDT_ABI)
LIBRARY_NAME = "_copy_runs.so"  # native/build.py builds it (stdlib only, so not imported here)
LIBRARY_PATH = Path(__file__).resolve().parent.parent / "native" / LIBRARY_NAME
STREAM_MIN_NBYTES = 1024
# plans smaller than this stay in the cache (memcpy): the reader is often about to touch them
STREAM_PLAN_MIN_NBYTES = 256 << 10
_NEVER = 1 << 62
_I64P = ctypes.POINTER(ctypes.c_int64)


def _load(path: Path = LIBRARY_PATH) -> tuple[ctypes.CDLL | None, str]:
    """The loaded library, or None and why not."""
    if os.environ.get("PD_TRANSFER_NATIVE_COPY", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "turned off by PD_TRANSFER_NATIVE_COPY"
    if not path.exists():
        return None, (
            f"{path} is not built (no C compiler when pd-transfer was installed); "
            f"build it with: python -m pd_transfer.transport.native.build"
        )
    try:
        lib = ctypes.CDLL(str(path))
        abi = lib.pdt_abi()
    except (OSError, AttributeError) as err:
        return None, f"{path} does not load: {err}"
    if abi != ABI:
        return None, f"{path} is ABI {abi}, this pd-transfer needs {ABI}: rebuild it"
    lib.pdt_copy_range.restype = ctypes.c_int64
    lib.pdt_copy_range.argtypes = [ctypes.c_int64, *[_I64P] * 6, *[ctypes.c_int64] * 4]
    lib.pdt_copy_list.restype = ctypes.c_int64
    lib.pdt_copy_list.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.pdt_copy_grid.restype = ctypes.c_int64
    lib.pdt_copy_grid.argtypes = [
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        *[ctypes.c_int64] * 5,
    ]
    lib.pdt_pack.restype = ctypes.c_int64
    lib.pdt_pack.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 4]
    return lib, ""


_LIB: Any  # a CDLL, or None; the copy functions below run only where AVAILABLE
_LIB, UNAVAILABLE_WHY = _load()
AVAILABLE = _LIB is not None
STREAMS = bool(_LIB.pdt_streams()) if _LIB is not None else False


def describe(native: bool) -> str:
    """How an engine with ``native`` on (or off) copies, for logs and /status."""
    if native:
        return "native loop" + (", non-temporal stores" if STREAMS else "")
    return f"numpy ({UNAVAILABLE_WHY or 'native loop turned off'})"


class Pieces:
    """A plan's descriptors as absolute addresses, ready for :meth:`copy`."""

    def __init__(
        self, flat: Flat, src: dict[str, Mapped], dst: dict[str, Mapped], *, stream_min: int | None = None
    ) -> None:
        src_base = np.fromiter((src[b.src_region].address for b in flat.batches), np.int64, len(flat.batches))
        dst_base = np.fromiter((dst[b.dst_region].address for b in flat.batches), np.int64, len(flat.batches))
        batch = np.asarray(flat.batch)
        self.columns = [
            np.ascontiguousarray(a, np.int64)
            for a in (
                src_base[batch] + flat.src_offset,
                dst_base[batch] + flat.dst_offset,
                flat.nbytes,
                flat.count,
                flat.src_stride,
                flat.dst_stride,
            )
        ]
        self._pointers = [a.ctypes.data_as(_I64P) for a in self.columns]
        sizes = np.where((flat.nbytes > 0) & (flat.count > 0), flat.nbytes * flat.count, 0)
        self.ends = np.cumsum(sizes, dtype=np.int64)  # bytes up to each descriptor's end
        self.nbytes = int(self.ends[-1]) if len(self.ends) else 0
        self.stream_min = _stream_min(self.nbytes) if stream_min is None else stream_min

    def ranges(self, parts: int, *, align: int = 4096) -> list[tuple[int, int]]:
        """``parts`` (start, length) byte ranges of about equal length covering the plan."""
        cuts = (
            [0]
            + [min(self.nbytes, self.nbytes * j // parts // align * align) for j in range(1, parts)]
            + [self.nbytes]
        )
        return [(a, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]

    def copy(self, start: int = 0, length: int | None = None) -> int:
        """Copy ``length`` bytes (default: to the end) from byte ``start`` of the plan."""
        length = self.nbytes - start if length is None else length
        if length <= 0:
            return 0
        first = int(np.searchsorted(self.ends, start, side="right"))
        skip = start - (int(self.ends[first - 1]) if first else 0)
        done = _LIB.pdt_copy_range(
            len(self.columns[0]), *self._pointers, first, skip, length, self.stream_min
        )
        _check_landed(done)
        if done != length:  # the plan and its columns disagree: a bug here, not bad input
            raise RuntimeError(f"native copy moved {done} of {length} bytes")
        return done


def copy_list(runs: list[int]) -> None:
    """Copy the runs ``runs`` lists flat as ``dst_address, src_address, nbytes, ...``,
    each already bounds-checked, in one call. For a 1-page room's few dozen runs:
    little code between the request and the copy, since on an idle host every
    instruction before it runs several times slower than when warm."""
    table = array("q", runs)
    address, length = table.buffer_info()
    total = sum(runs[2::3])
    done = _LIB.pdt_copy_list(length // 3, address, _stream_min(total))
    _check_landed(done)
    if done != total:
        raise RuntimeError(f"native copy moved {done} of {total} bytes")


def copy_grid(
    src_unit: np.ndarray, dst_unit: np.ndarray, src_index: array, dst_index: array, shape, total_nbytes: int
) -> None:
    """Copy one grid (:class:`~pd_transfer.layout.grids.Grid`) in one call: unit base
    addresses (int64 arrays), the index lists' byte offsets (``array("q")``, as long as
    each other) and the group's shape (run, count, strides, positions), every extreme
    already checked (:mod:`~pd_transfer.transport.copy.grid`). ``total_nbytes``: the whole plan's, which
    decides the stores."""
    if not len(src_index):
        return
    combo_src, combo_dst = shape.combo_src, shape.combo_dst
    expected = len(src_unit) * len(src_index) * len(combo_src) * shape.count * shape.run_nbytes
    done = _LIB.pdt_copy_grid(
        len(src_unit),
        src_unit.ctypes.data,
        dst_unit.ctypes.data,
        len(src_index),
        src_index.buffer_info()[0],
        dst_index.buffer_info()[0],
        len(combo_src),
        combo_src.ctypes.data,
        combo_dst.ctypes.data,
        shape.run_nbytes,
        shape.count,
        shape.src_stride,
        shape.dst_stride,
        _stream_min(total_nbytes),
    )
    _check_landed(done)
    if done != expected:
        raise RuntimeError(f"native copy moved {done} of {expected} bytes")


def _check_landed(done: int) -> None:
    """-1: a piece met a SIGBUS in a watched segment (:mod:`pd_transfer.memory.segment_guard`)."""
    if done == -1:
        raise TransportError(
            "a shared-memory segment was truncated under its mapping during the copy",
            code=Reason.SEGMENT_TRUNCATED,
        )


def _stream_min(total_nbytes: int) -> int:
    return STREAM_MIN_NBYTES if total_nbytes >= STREAM_PLAN_MIN_NBYTES else _NEVER


def _array_address(buffer: np.ndarray) -> int:
    return buffer.__array_interface__["data"][0]


def gather_runs(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> None:
    """Copy the runs ``(offset, nbytes)`` of ``region`` back to back into ``out`` (checked
    by the caller); plain stores, since ``out`` is about to be read (a staging buffer)."""
    _packed(offset, nbytes, region, out, gather=True)


def scatter_runs(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, payload: np.ndarray) -> None:
    """Copy ``payload`` (the runs back to back) into the runs ``(offset, nbytes)`` of
    ``region`` (checked by the caller)."""
    _packed(offset, nbytes, region, payload, gather=False)


def _packed(
    offset: np.ndarray, nbytes: np.ndarray, region: np.ndarray, buffer: np.ndarray, *, gather: bool
) -> None:
    offset = np.ascontiguousarray(offset, np.int64)
    nbytes = np.ascontiguousarray(nbytes, np.int64)
    total = int(nbytes.sum())
    if total > buffer.nbytes:
        raise ValueError(f"{total} bytes of runs do not fit a buffer of {buffer.nbytes}")
    # the callers checked every run (plans, check_wire); C trusts addresses, so once more
    # here, cheaply, rather than write outside the region on a bug
    if len(offset) != len(nbytes) or (
        len(offset)
        and (int(offset.min()) < 0 or int(nbytes.min()) < 0 or int((offset + nbytes).max()) > region.nbytes)
    ):
        raise ValueError(f"runs outside the region of {region.nbytes} bytes")
    done = _LIB.pdt_pack(
        len(nbytes),
        _array_address(offset),
        _array_address(nbytes),
        _array_address(region),
        _array_address(buffer),
        int(gather),
        _NEVER if gather else _stream_min(total),
    )
    _check_landed(done)
    if done != total:
        raise RuntimeError(f"native copy moved {done} of {total} bytes")
