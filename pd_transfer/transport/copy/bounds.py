"""Bounds-checking a flattened plan against the regions it reads and writes. Pure numpy.

Every piece of every descriptor is checked against both regions before
anything moves (:func:`check_bounds`), with a handful of numpy calls per plan,
and the first offender is named: batch, descriptor, its pieces and the region.

No torch, no asyncio, no zmq.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.runs import Flat

# Extents are first computed in float64: anything beyond this is out of every
# region, and anything below it is exact in int64 without overflow.
_SAFE_EXTENT = float(2**62)


def check_bounds(
    flat: Flat, src_sizes: Mapping[str, int] | None, dst_sizes: Mapping[str, int] | None, where: str = "plan"
) -> None:
    """Raise :class:`TransportError` unless every piece lies inside its regions.

    ``None`` for a side skips it (the tcp sender checks only its source; the
    receiver checks the destination against what it registered).
    """
    for side, sizes in (("source", src_sizes), ("destination", dst_sizes)):
        if sizes is None:
            continue
        attr = "src_region" if side == "source" else "dst_region"
        region_ids = [getattr(b, attr) for b in flat.batches]
        missing = sorted({r for r in region_ids if r not in sizes})
        if missing:
            raise TransportError(
                f"{where}: {side} region(s) {missing} are not mapped (known: {len(sizes)} regions)",
                code=Reason.UNKNOWN_REGION,
            )
        size = np.array([sizes[r] for r in region_ids], np.int64)
        # one region size for all (one batch, or one pool's layers): compare to a scalar
        size = size[0] if len(size) and int(size.min()) == int(size.max()) else size[flat.batch]
        offset = flat.src_offset if side == "source" else flat.dst_offset
        stride = flat.src_stride if side == "source" else flat.dst_stride
        bad = _out_of_bounds(offset, flat.nbytes, flat.count, stride, size)
        if bad.any():
            _raise_out_of_bounds(flat, np.flatnonzero(bad), side, region_ids, size, where)


def _out_of_bounds(
    offset: np.ndarray, nbytes: np.ndarray, count: np.ndarray, stride: np.ndarray, size: np.ndarray
) -> np.ndarray:
    """Per descriptor: does any of its pieces leave ``[0, size)``?"""
    if len(count) and int(count.min()) == 1 == int(count.max()):
        # one piece each (a page run): no stride to overflow; ``size - offset`` cannot
        # overflow once offset is in [0, size]
        return (offset < 0) | (nbytes < 0) | (offset > size) | (nbytes > size - offset)
    span = (count.astype(np.float64) - 1) * stride
    lo_f = offset + np.minimum(span, 0)
    hi_f = offset + np.maximum(span, 0) + nbytes
    empty = (count == 0) | (nbytes == 0)
    huge = (np.abs(lo_f) >= _SAFE_EXTENT) | (np.abs(hi_f) >= _SAFE_EXTENT)
    with np.errstate(over="ignore"):
        span_i = np.where(huge, 0, (count - 1) * stride)
        lo = offset + np.minimum(span_i, 0)
        hi = offset + np.maximum(span_i, 0) + nbytes
    negative = (count < 0) | (nbytes < 0)
    return negative | (~empty & (huge | (lo < 0) | (hi > size)))


def _raise_out_of_bounds(
    flat: Flat, bad: np.ndarray, side: str, region_ids: list[str], size: np.ndarray | np.int64, where: str
) -> None:
    i = int(bad[0])
    b = int(flat.batch[i])
    first = i - int(np.searchsorted(flat.batch, b))
    offset = int((flat.src_offset if side == "source" else flat.dst_offset)[i])
    stride = int((flat.src_stride if side == "source" else flat.dst_stride)[i])
    nbytes, count = int(flat.nbytes[i]), int(flat.count[i])
    piece = f"{count} piece(s) of {nbytes} bytes at offset {offset}"
    if count > 1:
        piece += f", stride {stride} (last piece ends at {offset + (count - 1) * stride + nbytes})"
    region_nbytes = int(np.broadcast_to(size, flat.batch.shape)[i])
    raise TransportError(
        f"{where}: batch {b} descriptor {first}: {piece} is outside {side} region "
        f"{region_ids[b]!r} of {region_nbytes} bytes; {len(bad)} descriptor(s) out of bounds, "
        f"nothing was copied",
        code=Reason.RUN_OUT_OF_REGION,
        hint="the plan and the registered regions disagree: re-register, or the peer's geometry is stale",
    )
