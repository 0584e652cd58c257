"""Deterministic bytes of every logical element: the sim's ground truth.

Every logical tensor (key ``(pool, layer_id, name)``) holds, at source index
``i`` and logical coordinates ``c`` (one per axis *name*, the shard axis in
global coordinates), a value that depends only on ``(seed, key, i, c)``::

    position = linear index of c, axes in name order, shard axis at its global extent
    base     = splitmix64(key_seed("base", key) + position)         one word per element
    salt     = splitmix64(key_seed(seed, key) + i)                  one word per item
    lanes    = 8 // itemsize       (a bfloat16 element uses 16 of the salt's 64 bits)
    value    = low itemsize bytes of base ^ (salt >> 8 * itemsize * (position % lanes))

so a prefill rank can write its shard of a page and a decode rank with a
different TP size, a different memory layout or a different axis order can
check its own shard of it, each knowing nothing but its own geometry.

Why two words instead of one hash per element: a full splitmix64 per element
costs about eleven passes over 8-byte words and made filling and checking
the slowest part of a demo; here ``base`` is computed once per view and each
item costs one shift, one narrowing copy and one xor. It still catches what
a transfer gets wrong: a byte at the wrong position differs through
``base`` (a full 64-bit mix of the position), an item from the wrong index
or an earlier request (another seed) differs through ``salt`` unless the
two salts agree on every lane, about 2**-64.

Nothing is materialised beyond one bounded chunk of index items at a time.

Shard axis, local -> global (GDN conv ``[q | k | v]``, groups (4, 4, 8) on
tp rank 1 of 2, ranges ((2,4), (2,4), (4,8))): local element 4 is in group 2
(local elements 4..7), so global = group base 8 + range start 4 + (4 - 4) = 12.

Imports numpy and the layout description only.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pd_transfer.errors import GeometryError, PlanError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.views import AxisRole, Pool, ShardSpec, TensorView

MAX_LINES = 20
CHUNK_ELEMS = 1 << 17  # 1 MiB per uint64 temporary while computing a chunk of items

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

Requests = Mapping[Pool, tuple]  # pool -> (src_indices, dst_indices)

# every dtype is 1, 2, 4 or 8 bytes; its content is handled as the unsigned int of that size
_ELEMENT: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    1: np.dtype("u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


def key_seed(seed: int | str, key: tuple) -> np.uint64:
    """A 64-bit seed per (seed, tensor key), stable across processes and Python versions."""
    pool, layer_id, name = key
    text = f"{seed}|{pool.value}|{layer_id}|{name}".encode()
    return np.uint64(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little"))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, in place on a uint64 array (wrapping arithmetic)."""
    x += _GOLDEN
    for shift, factor in ((_S30, _MIX1), (_S27, _MIX2), (_S31, None)):
        x ^= x >> shift
        if factor is not None:
            x *= factor
    return x


def global_positions(shard: ShardSpec) -> np.ndarray:
    """Global position of each local element of a shard axis (see the module docstring)."""
    bases = np.concatenate(([0], np.cumsum(shard.groups[:-1], dtype=np.int64)))
    return np.concatenate(
        [
            np.arange(base + start, base + end, dtype=np.int64)
            for base, (start, end) in zip(bases, shard.ranges)
        ]
    )


@dataclass(frozen=True, eq=False)
class ViewContent:
    """How to compute one view's items (see the module docstring); built once per view.

    ``base`` and ``shifts`` have the view's shape with the index axis of
    extent 1: each element's base value (already narrowed to the view's
    element type) and the shift that picks its lane of the item's salt.
    """

    view: TensorView
    index_axis: int
    base: np.ndarray
    shifts: np.ndarray | None  # None: one lane (8-byte elements), the salt as it is

    @staticmethod
    def of(view: TensorView) -> ViewContent:
        return _content_of(view)

    @property
    def chunk_items(self) -> int:
        return max(1, CHUNK_ELEMS // self.base.size)

    def values_of(self, seed: int, src_indices: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
        """Content of items ``src_indices`` as unsigned ints of the view's itemsize.

        Shape: the view's, with the index axis of extent ``len(src_indices)``.
        The result lives in ``scratch`` (when given) until its next use:
        fresh multi-MiB arrays come from ``mmap``, and page-faulting them in
        would cost more than computing the values.
        """
        shape = list(self.base.shape)
        shape[self.index_axis] = len(src_indices)
        salt = splitmix64(src_indices.astype(np.uint64) + key_seed(seed, self.view.key))
        salt = salt.reshape([len(src_indices) if j == self.index_axis else 1 for j in range(len(shape))])
        words, out = (scratch or Scratch()).arrays(shape, self.base.dtype)
        if self.shifts is None:
            np.bitwise_xor(salt, self.base, out=out)
        else:
            np.right_shift(salt, self.shifts, out=words)
            np.copyto(out, words, casting="unsafe")
            out ^= self.base
        return out


@functools.lru_cache(maxsize=4096)
def _content_of(view: TensorView) -> ViewContent:
    index_axis = view.axis_of(AxisRole.INDEX)
    coords: dict[str, np.ndarray] = {}
    extents: dict[str, int] = {}
    for j, axis in enumerate(view.axes):
        if j == index_axis:
            continue
        if axis.role is AxisRole.SHARD and view.shard is not None:
            coords[axis.name] = global_positions(view.shard)
            extents[axis.name] = view.shard.global_extent
        else:
            # a shard axis without metadata counts as whole: reconciliation
            # refuses to slice it, so both sides hold the same extent
            coords[axis.name] = np.arange(view.shape[j], dtype=np.int64)
            extents[axis.name] = view.shape[j]
    multiplier = 1
    position = np.zeros([1] * len(view.axes), dtype=np.uint64)
    for name in sorted(coords, reverse=True):  # the last name varies fastest
        j = view.axis_named(name)
        shape = [1] * len(view.axes)
        shape[j] = view.shape[j]
        position = position + (coords[name] * multiplier).astype(np.uint64).reshape(shape)
        multiplier *= extents[name]
    dtype = _ELEMENT[view.itemsize]
    base = splitmix64(position + key_seed("base", view.key)).astype(dtype)
    lanes = 8 // view.itemsize
    shifts = None if lanes == 1 else (position % np.uint64(lanes)) * np.uint64(8 * view.itemsize)
    return ViewContent(view, index_axis, base, shifts)


class Scratch:
    """Reusable buffers for :meth:`ViewContent.values_of`."""

    def __init__(self) -> None:
        self._words = np.empty(0, np.uint64)
        self._out = np.empty(0, np.uint8)

    def arrays(self, shape: list[int], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        size = math.prod(shape)
        if self._words.size < size:
            self._words = np.empty(size, np.uint64)
            self._out = np.empty(8 * size, np.uint8)
        return (
            self._words[:size].reshape(shape),
            self._out[: size * dtype.itemsize].view(dtype).reshape(shape),
        )


def window(buf: np.ndarray, view: TensorView) -> np.ndarray:
    """The view's elements in the flat uint8 ``buf``, as unsigned ints aliasing it.

    Bounds are checked here: ``np.ndarray`` with explicit strides would
    otherwise happily reach past the buffer.
    """
    if buf.dtype != np.uint8 or buf.ndim != 1:
        raise TypeError(f"{view.path}: region buffers must be flat uint8 arrays")
    end = view.span_nbytes()[1]
    if end > buf.size:
        raise GeometryError(
            f"{view.path}: reaches byte {end} of region {view.region!r}, whose buffer holds {buf.size}",
            code=Reason.VIEW_OUT_OF_REGION,
        )
    return np.ndarray(
        tuple(view.shape),
        dtype=_ELEMENT[view.itemsize],
        buffer=buf,
        offset=view.offset_nbytes,
        strides=tuple(view.strides_nbytes),
    )


def _take(axis: int, indices: np.ndarray) -> tuple:
    """An index tuple selecting ``indices`` along ``axis``."""
    return (slice(None),) * axis + (indices,)


def _indices(name: str, values, count: int, view: TensorView) -> np.ndarray:
    indices = np.asarray(values, dtype=np.int64).reshape(-1)
    if indices.size and (indices.min() < 0 or indices.max() >= count):
        bad = int(indices.min()) if indices.min() < 0 else int(indices.max())
        raise PlanError(
            f"{view.path}: {name} index {bad} is outside 0..{count - 1}", code=Reason.INDEX_OUT_OF_RANGE
        )
    return indices


def fill_source(
    geometry: RankGeometry,
    region_arrays: Mapping[str, np.ndarray],
    seed: int,
    pool_indices: Mapping[Pool, object] | None = None,
) -> int:
    """Write every view's content at every index (or only ``pool_indices[pool]``).

    Item ``i`` gets the content of source index ``i``. Pools missing from
    ``pool_indices`` are left alone. Returns the logical bytes written.
    """
    written = 0
    scratch = Scratch()
    for view in geometry.views:
        if pool_indices is None:
            indices = np.arange(view.index_count, dtype=np.int64)
        elif view.pool in pool_indices:
            indices = _indices("source", pool_indices[view.pool], view.index_count, view)
        else:
            continue
        content = ViewContent.of(view)
        target = window(region_arrays[view.region], view)
        for start in range(0, len(indices), content.chunk_items):
            chunk = indices[start : start + content.chunk_items]
            target[_take(content.index_axis, chunk)] = content.values_of(seed, chunk, scratch)
        written += len(indices) * view.item_nbytes
    return written


@dataclass(frozen=True)
class Verification:
    """What :func:`verify_destination` found: discrepancy lines and how much it checked."""

    lines: list[str]
    items_checked: int
    items_wrong: int
    nbytes_checked: int

    @property
    def ok(self) -> bool:
        return not self.lines


def check_destination(
    geometry: RankGeometry, region_arrays: Mapping[str, np.ndarray], seed: int, requests: Requests
) -> list[str]:
    """Discrepancy lines (empty: byte-exact) of a decode rank after a transfer.

    For every view of a requested pool, item ``dst[i]`` must hold the content
    of source index ``src[i]``, cut to the view's own shard ranges. At most
    ``MAX_LINES`` lines, plus one counting the rest.
    """
    return verify_destination(geometry, region_arrays, seed, requests).lines


def verify_destination(
    geometry: RankGeometry,
    region_arrays: Mapping[str, np.ndarray],
    seed: int,
    requests: Requests,
    max_lines: int = MAX_LINES,
) -> Verification:
    lines: list[str] = []
    checked = wrong = nbytes = 0
    scratch = Scratch()
    for view in geometry.views:
        if view.pool not in requests:
            continue
        src_raw, dst_raw = requests[view.pool]
        src = np.asarray(src_raw, dtype=np.int64).reshape(-1)
        dst = _indices("destination", dst_raw, view.index_count, view)
        if src.shape != dst.shape:
            raise PlanError(
                f"{view.path}: {src.size} source and {dst.size} destination indices",
                code=Reason.INDEX_COUNT_MISMATCH,
            )
        content = ViewContent.of(view)
        got_all = window(region_arrays[view.region], view)
        for start in range(0, len(dst), content.chunk_items):
            part = slice(start, start + content.chunk_items)
            want = content.values_of(seed, src[part], scratch)
            got = got_all[_take(content.index_axis, dst[part])]
            diff = np.moveaxis(got != want, content.index_axis, 0)
            bad_items = np.flatnonzero(diff.reshape(diff.shape[0], -1).any(axis=1))
            wrong += bad_items.size
            for i in bad_items[: max(0, max_lines - len(lines))]:
                lines.append(
                    _describe(
                        geometry,
                        view,
                        content,
                        diff[i],
                        got,
                        want,
                        int(src[part][i]),
                        int(dst[part][i]),
                        int(i),
                    )
                )
        checked += len(dst)
        nbytes += len(dst) * view.item_nbytes
    if wrong > len(lines):
        lines.append(f"... {wrong} wrong items in total, first {len(lines)} shown")
    return Verification(lines, checked, wrong, nbytes)


def _describe(
    geometry: RankGeometry,
    view: TensorView,
    content: ViewContent,
    diff: np.ndarray,
    got: np.ndarray,
    want: np.ndarray,
    src: int,
    dst: int,
    i: int,
) -> str:
    """One line for one wrong item: its first wrong element, by axis name."""
    position: list[Any] = list(np.unravel_index(int(np.argmax(diff)), diff.shape))
    position.insert(content.index_axis, i)
    element = tuple(position)
    coords = []
    for j, axis in enumerate(view.axes):
        if j == content.index_axis:
            continue
        if axis.role is AxisRole.SHARD and view.shard is not None:
            coords.append(f"{axis.name}={int(global_positions(view.shard)[element[j]])} (global)")
        else:
            coords.append(f"{axis.name}={int(element[j])}")
    digits = 2 * view.itemsize
    index_name = view.axes[content.index_axis].name
    return (
        f"{geometry.rank_id} {view.path} {index_name} dst={dst} src={src}: "
        f"{int(np.count_nonzero(diff))}/{diff.size} elements differ, first at "
        f"{' '.join(coords)}: got 0x{int(got[element]):0{digits}x} "
        f"want 0x{int(want[element]):0{digits}x}"
    )
