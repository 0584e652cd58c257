"""Test helpers: mark the bytes each view touches, and read torch strides in bytes.

Marks go into one numpy bool array per region through
``np.lib.stride_tricks.as_strided``, so a view's bytes are found by numpy from
its shape and byte strides, independently of how the builders computed them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pd_transfer.layout.views import TensorView


def byte_window(marks: np.ndarray, view: TensorView) -> np.ndarray:
    """A writable window onto ``marks`` covering every byte of ``view``."""
    shape = view.shape + (view.itemsize,)
    strides = view.strides_nbytes + (1,)
    return np.lib.stride_tricks.as_strided(
        marks[view.offset_nbytes :], shape=shape, strides=strides, writeable=True
    )


def mark_views(regions: dict[str, int], views) -> dict[str, np.ndarray]:
    """Mark every view's bytes; fail if a view leaves its region or overlaps another.

    A view marks ``prod(shape) * itemsize`` bytes; if fewer new bytes turn
    True, some byte was marked twice (by this view or an earlier one).
    """
    marks = {rid: np.zeros(nbytes, dtype=bool) for rid, nbytes in regions.items()}
    for view in views:
        first, last = view.span_nbytes()
        assert 0 <= first and last <= regions[view.region], (view.path, last, regions[view.region])
        region_marks = marks[view.region]
        before = int(np.count_nonzero(region_marks))
        byte_window(region_marks, view)[...] = True
        added = int(np.count_nonzero(region_marks)) - before
        assert added == math.prod(view.shape) * view.itemsize, f"{view.path} overlaps"
    return marks


def torch_layout(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(byte offset, shape, byte strides)`` of a torch tensor in its storage."""
    isz = t.element_size()
    return t.storage_offset() * isz, tuple(t.shape), tuple(s * isz for s in t.stride())


def view_layout(view: TensorView) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return view.offset_nbytes, view.shape, view.strides_nbytes


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
