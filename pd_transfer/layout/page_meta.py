"""Zero-copy page metadata: one contiguous ``(offset, nbytes)`` per page per group.

Storage backends that move whole pages without a gather need each page of a
tensor group (all layers' K of a host pool, say) to be one contiguous byte
range. That holds for ``page_first`` and ``page_first_direct`` host pools and
for nothing else; :func:`page_buffer_meta` returns the ranges or raises a
:class:`LayoutError` naming the layout and the layouts that would work.
:func:`require_page_granular` checks what a page-granular ("direct", no
gather) copy of each layer needs instead: every layer's page on its own is
contiguous. NHD and HND device pools give that, and among host layouts
``page_first_direct`` and ``layer_first`` (the two SGLang's ``direct`` io
backend takes), not ``page_first`` or ``page_head``.

Both also check the layout by measurement (the bytes of a page really tile
one range), so a mislabelled view cannot slip through. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import LayoutError, Reason
from pd_transfer.layout.views import AxisRole, Layout, Pool, TensorView

PAGE_LAYOUTS = (Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)


@dataclass(frozen=True)
class PageBuffers:
    """Pages of one tensor group: page ``i`` is ``[offsets[i], offsets[i] + nbytes)``."""

    group: str
    region: str
    offsets: np.ndarray
    nbytes: int


def page_buffer_meta(
    views: Sequence[TensorView], token_indices: np.ndarray, page_size: int
) -> list[PageBuffers]:
    """Per tensor group (region and tensor name), one contiguous range per page."""
    pages = _pages_of(token_indices, page_size)
    _require_page_layout(views)
    groups: dict[tuple[str, str], list[TensorView]] = {}
    for view in views:
        groups.setdefault((view.region, view.name), []).append(view)
    result = []
    for (region, name), members in groups.items():
        base, stride, nbytes = _envelope(members, name)
        result.append(PageBuffers(name, region, base + pages * stride, nbytes))
    return result


def require_page_granular(views: Sequence[TensorView]) -> None:
    """Raise unless every view's page (one layer) is one contiguous range."""
    for view in views:
        if _item_contiguous(view):
            continue
        suggestion = (
            "page_first_direct"
            if view.layout.is_host
            else "a device layout whose pages are contiguous (nhd or hnd)"
        )
        asymmetric = _is_asymmetric(views)
        raise LayoutError(
            f"{view.path} ({view.layout.value}): a page of one layer is not one contiguous "
            f"range, so a page-granular (direct, no gather) copy is impossible"
            + (
                "; models with head_dim != v_head_dim must use page_first_direct for direct copies"
                if asymmetric
                else ""
            ),
            code=Reason.LAYOUT_UNSUPPORTED,
            hint=f"allocate the pool as {suggestion}, or use the gathering (kernel) path",
        )


def _pages_of(token_indices: np.ndarray, page_size: int) -> np.ndarray:
    idx = np.asarray(token_indices, dtype=np.int64).reshape(-1)
    if page_size <= 0 or len(idx) % page_size:
        raise LayoutError(
            f"index list of {len(idx)} tokens is not a multiple of page_size {page_size}",
            code=Reason.INDEX_NOT_PAGE_ALIGNED,
            hint="pass whole pages of token indices",
        )
    rows = idx.reshape(-1, page_size)
    first = rows[:, :1]
    if np.any(first % page_size) or np.any(rows != first + np.arange(page_size)):
        raise LayoutError(
            "token indices do not form whole, aligned pages (each page must be "
            f"p*{page_size} .. p*{page_size}+{page_size - 1} in order)",
            code=Reason.INDEX_NOT_PAGE_ALIGNED,
            hint="pass whole pages of token indices",
        )
    return first[:, 0] // page_size


def _require_page_layout(views: Sequence[TensorView]) -> None:
    ok = ", ".join(layout.value for layout in PAGE_LAYOUTS)
    for view in views:
        if view.pool is Pool.MAMBA and view.name.startswith("side"):
            raise LayoutError(
                f"{view.path}: zero-copy page metadata does not cover registered per-slot side "
                "states: they live in their own rows outside the slot's page envelope",
                code=Reason.LAYOUT_UNSUPPORTED,
                hint="use a whole-page storage path for Mamba pools with side states",
            )
        if view.layout not in PAGE_LAYOUTS:
            what = (
                "models with head_dim != v_head_dim" if _is_asymmetric(views) else f"{view.pool.value} pools"
            )
            raise LayoutError(
                f"zero-copy page metadata for {what} needs a page layout ({ok}); "
                f"{view.path} is {view.layout.value}, whose pages are not contiguous",
                code=Reason.LAYOUT_UNSUPPORTED,
                hint=f"allocate the host pool as {ok}",
            )


def _envelope(members: list[TensorView], name: str) -> tuple[int, int, int]:
    """``(base, page_stride, nbytes)`` of the group, checked byte by byte on page 0."""
    strides = {v.strides_nbytes[v.axis_of(AxisRole.INDEX)] for v in members}
    base = min(v.offset_nbytes for v in members)
    nbytes = sum(v.item_nbytes for v in members)
    covered = np.zeros(nbytes, dtype=np.int32)
    inside = len(strides) == 1
    for view in members:
        if not inside:
            break
        first_page = [n if i != view.axis_index(AxisRole.INDEX) else 1 for i, n in enumerate(view.shape)]
        offsets = _byte_offsets(view, first_page) - base
        inside = bool(offsets.size) and offsets.min() >= 0 and offsets.max() < nbytes
        if inside:
            np.add.at(covered, offsets, 1)
    if not inside or not np.all(covered == 1):
        raise LayoutError(
            f"pages of tensor group {name!r} do not form one contiguous range per page",
            code=Reason.LAYOUT_UNSUPPORTED,
            hint="allocate the host pool as page_first or page_first_direct",
        )
    return base, strides.pop(), nbytes


def _byte_offsets(view: TensorView, shape: list[int]) -> np.ndarray:
    offsets = np.array([view.offset_nbytes], dtype=np.int64)
    for n, stride in zip(shape + [view.itemsize], list(view.strides_nbytes) + [1]):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).ravel()
    return offsets


def _item_contiguous(view: TensorView) -> bool:
    index = view.axis_index(AxisRole.INDEX)
    expected = view.itemsize
    for i in sorted((i for i in range(len(view.shape)) if i != index), key=lambda i: view.strides_nbytes[i]):
        if view.shape[i] == 1:
            continue
        if view.strides_nbytes[i] != expected:
            return False
        expected *= view.shape[i]
    return True


def _is_asymmetric(views: Sequence[TensorView]) -> bool:
    dims: dict[str, set[int]] = {}
    for view in views:
        inner = view.extent(AxisRole.INNER)
        if view.name in ("k", "v") and inner:
            dims.setdefault(view.name, set()).add(inner)
    return bool(dims.get("k")) and bool(dims.get("v")) and dims["k"] != dims["v"]
