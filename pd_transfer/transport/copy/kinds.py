"""The copy tasks a worker thread runs, and how a long one is cut for several threads.

Four kinds (:mod:`pd_transfer.transport.copy.tasks` says when each is chosen):
:class:`CopyRun` (one memcpy), :class:`TakeInto` (a gather straight into the
destination), :class:`PutFrom` (a scatter straight from the source) and
:class:`Bounce` (a gather into the worker's :class:`BounceBuffer`, then a
scatter from it). Each task's ``run`` takes that buffer. numpy only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# a put of a few hundred rows keeps the GIL: puts are cut no finer than this
PUT_MIN_ROWS = 512


_VOID_DTYPES: dict[int, np.dtype] = {}


def void_dtype(nbytes: int) -> np.dtype:
    """The (cached) numpy dtype of an opaque ``nbytes``-byte item."""
    dtype = _VOID_DTYPES.get(nbytes)
    if dtype is None:
        dtype = _VOID_DTYPES[nbytes] = np.dtype((np.void, nbytes))
    return dtype


class BounceBuffer:
    """A worker thread's bounce buffer."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.empty(nbytes, np.uint8)


class CopyRun(NamedTuple):  # NamedTuples: a plan makes thousands, and they build fastest
    src: np.ndarray
    dst: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.dst.size

    def run(self, scratch: BounceBuffer) -> None:
        np.copyto(self.dst, self.src)


class TakeInto(NamedTuple):
    src_rows: np.ndarray
    rows: np.ndarray  # which source rows, in order
    dst: np.ndarray  # the stretch, as rows of the source row size

    @property
    def nbytes(self) -> int:
        return self.dst.nbytes

    def run(self, scratch: BounceBuffer) -> None:
        np.take(self.src_rows, self.rows, out=self.dst, mode="clip")


class PutFrom(NamedTuple):
    dst_rows: np.ndarray
    rows: np.ndarray  # which destination rows, in order
    src: np.ndarray  # the source stretch, as rows of the destination row size

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    def run(self, scratch: BounceBuffer) -> None:
        np.put(self.dst_rows, self.rows, self.src)


class Bounce(NamedTuple):
    src_rows: np.ndarray
    src_index: np.ndarray
    dst_rows: np.ndarray
    dst_index: np.ndarray
    nbytes: int

    def run(self, scratch: BounceBuffer) -> None:
        buf = scratch.array[: self.nbytes]
        np.take(self.src_rows, self.src_index, out=buf.view(self.src_rows.dtype), mode="clip")
        np.put(self.dst_rows, self.dst_index, buf.view(self.dst_rows.dtype))


def split_tasks(tasks: list, split_nbytes: int) -> list:
    """Tasks of more than ``split_nbytes`` cut into consecutive pieces of about that length."""
    if not any(task.nbytes > split_nbytes for task in tasks):
        return tasks
    out = []
    for task in tasks:
        if task.nbytes <= split_nbytes or isinstance(task, Bounce):
            out.append(task)
        elif isinstance(task, CopyRun):
            out += [
                CopyRun(task.src[a : a + split_nbytes], task.dst[a : a + split_nbytes])
                for a in range(0, task.nbytes, split_nbytes)
            ]
        elif isinstance(task, TakeInto):
            step = max(1, split_nbytes // task.dst.itemsize)
            out += [
                TakeInto(task.src_rows, task.rows[a : a + step], task.dst[a : a + step])
                for a in range(0, len(task.rows), step)
            ]
        else:  # a put of a few hundred rows keeps the GIL (numpy 2.4: 256 rows did, 8,192 not)
            step = max(PUT_MIN_ROWS, split_nbytes // task.src.itemsize)
            out += [
                PutFrom(task.dst_rows, task.rows[a : a + step], task.src[a : a + step])
                for a in range(0, len(task.rows), step)
            ]
    return out
