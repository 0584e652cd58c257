"""Where a registered view's bytes lie inside its region buffer, for the oracle.

A view is laid over a flat ``uint8`` region buffer with
``np.lib.stride_tricks.as_strided`` plus a trailing byte axis of stride 1, so
an element of dtype ``bfloat16`` shows up as two consecutive bytes.
``as_strided`` does no bounds checking at all, which is why :func:`fit_problem`
and :func:`overlap_problems` run before any window is ever made.

Imports numpy and the layout description only; never the planner,
reconciliation, lowering or sharding modules.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from pd_transfer.layout.views import TensorView


def view_nbytes(view: TensorView) -> int:
    """Bytes the view's elements cover (not its span: strides may leave gaps)."""
    return int(np.prod(view.shape, dtype=np.int64)) * view.itemsize


def fit_problem(view: TensorView, region_nbytes: int | None) -> str:
    """Why the view does not fit inside its region; "" if it does.

    The last byte is recomputed here rather than taken from
    ``TensorView.span_nbytes`` so that a wrong span cannot let a window
    escape its buffer.
    """
    if region_nbytes is None:
        return f"{view.path}: names region {view.region!r}, which the rank does not register"
    if view.offset_nbytes < 0 or min(view.strides_nbytes, default=0) < 0:
        return f"{view.path}: negative offset or stride"
    last_nbytes = view.offset_nbytes + view.itemsize
    for extent, stride_nbytes in zip(view.shape, view.strides_nbytes, strict=True):
        last_nbytes += (extent - 1) * stride_nbytes
    if last_nbytes > region_nbytes:
        return (
            f"{view.path}: reaches byte {last_nbytes} of region {view.region!r}, which holds {region_nbytes}"
        )
    return ""


def window(buf: np.ndarray, view: TensorView, order: tuple[int, ...] | None = None) -> np.ndarray:
    """The view's elements in ``buf``, as a writable array aliasing ``buf``.

    The result has the view's axes permuted by ``order`` (result axis ``i`` is
    view axis ``order[i]``; identity when None) followed by the byte axis.
    ``buf`` must be a 1-byte-per-item array (``uint8`` data or a ``bool``
    mask) and the caller must have checked :func:`fit_problem`.
    """
    if buf.itemsize != 1 or buf.ndim != 1:
        raise TypeError("region buffers are flat arrays of 1-byte items")
    shape = tuple(view.shape) + (view.itemsize,)
    strides = tuple(view.strides_nbytes) + (1,)
    full = as_strided(buf[view.offset_nbytes :], shape=shape, strides=strides)
    if order is None:
        return full
    return full.transpose(tuple(order) + (len(view.shape),))


def overlap_problems(views: list[TensorView], region_nbytes: int) -> list[str]:
    """Views of one region that share a byte (with each other or themselves).

    Marks every byte of every view in one mask and compares the count of
    marked bytes with the sum of the views' sizes; only when they differ is
    each view re-marked alone to name the culprits.
    """
    mask = np.zeros(region_nbytes, dtype=bool)
    for view in views:
        window(mask, view)[...] = True
    if int(np.count_nonzero(mask)) == sum(view_nbytes(v) for v in views):
        return []
    problems = []
    owner = np.zeros(region_nbytes, dtype=bool)
    for view in views:
        own = np.zeros(region_nbytes, dtype=bool)
        window(own, view)[...] = True
        if int(np.count_nonzero(own)) != view_nbytes(view):
            problems.append(f"{view.path}: its strides make it overlap itself")
        if np.any(own & owner):
            problems.append(f"{view.path}: overlaps an earlier view of region {view.region!r}")
        owner |= own
    return problems


def address_of(view: TensorView, flat_position: int) -> tuple[int, ...]:
    """The view-order coordinates (axes then byte) of the ``flat_position``-th byte."""
    return tuple(int(i) for i in np.unravel_index(flat_position, tuple(view.shape) + (view.itemsize,)))


def locate(views: list[TensorView], byte_nbytes: int) -> str:
    """Which view (and coordinates) byte ``byte_nbytes`` of a region belongs to.

    Used only to explain a discrepancy, so a brute-force search is fine.
    """
    for view in views:
        first = view.offset_nbytes
        addresses = np.full((), first, dtype=np.int64)
        for axis, (extent, stride_nbytes) in enumerate(zip(view.shape, view.strides_nbytes, strict=True)):
            shape = [1] * (len(view.shape) + 1)
            shape[axis] = extent
            addresses = addresses + (np.arange(extent, dtype=np.int64) * stride_nbytes).reshape(shape)
        addresses = addresses + np.arange(view.itemsize, dtype=np.int64)
        hits = np.flatnonzero(addresses.reshape(-1) == byte_nbytes)
        if hits.size:
            coords = address_of(view, int(hits[0]))
            names = [a.name for a in view.axes] + ["byte"]
            return f"{view.path}[" + ", ".join(f"{n}={c}" for n, c in zip(names, coords, strict=True)) + "]"
    return "outside every registered view"
