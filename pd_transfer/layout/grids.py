"""A small plan kept as grids: block copies not lowered to descriptors. Pure numpy.

A :class:`~pd_transfer.layout.lowering.UnitGroup` is a set of tensor pairs of
one structure; with a request's index lists it is a *grid*: for each unit
``u``, each index pair ``(i, j)``, each remaining-axes position ``c`` and
each ``k < count``, one piece of ``run_nbytes``::

    src: src_base[u] + i * src_index_stride + combo_src[c] + k * src_stride
    dst: dst_base[u] + j * dst_index_stride + combo_dst[c] + k * dst_stride

Lowering (:func:`~pd_transfer.layout.lowering.lower_groups`) turns that into
one :class:`~pd_transfer.layout.lowering.RunBatch` per unit (a 1-page room of
Llama-3.1-8B: 64 batches, one per layer and K/V, plus the aux row's), and a
writer then walks those batches. A copy loop that takes the grid itself skips
both steps: on this 2-vCPU VM, after 50 ms idle, planning and walking a
1-page room's 65 batches took 0.5-0.7 ms of Python, more than the copy.

:class:`GridPlan` is a :class:`TransferPlan` that keeps its grids and lowers
its batches only when something asks for them (a transport that takes byte
runs, a test), so it can go anywhere a plan goes. Its counts are the grid's:
``num_descriptors`` is one per (unit, index pair, position), pieces of
``count``; a lowered plan may merge consecutive pages into fewer.

Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pd_transfer.layout.lowering import TransferPlan, UnitGroup, lower_groups


@dataclass(frozen=True)
class Grid:
    """One unit group's block copies for one pair of index lists (checked by the planner)."""

    group: UnitGroup
    src_idx: np.ndarray
    dst_idx: np.ndarray

    @property
    def num_descriptors(self) -> int:
        return len(self.group.units) * len(self.src_idx) * len(self.group.shape.combo_src)

    @property
    def num_runs(self) -> int:
        return self.num_descriptors * self.group.shape.count

    @property
    def total_nbytes(self) -> int:
        return self.num_runs * self.group.shape.run_nbytes


class GridPlan(TransferPlan):
    """A plan of grids, in order (a room's aux row last); ``batches`` lowered on demand."""

    grids: tuple[Grid, ...]

    def __init__(self, src_rank: str, dst_rank: str, grids: tuple[Grid, ...]) -> None:
        # TransferPlan is a frozen dataclass: set the fields as its own __init__ would,
        # but leave ``batches`` to the cached property below
        object.__setattr__(self, "src_rank", src_rank)
        object.__setattr__(self, "dst_rank", dst_rank)
        object.__setattr__(self, "grids", grids)

    @cached_property
    def batches(self) -> tuple:
        indices = {}
        groups = []
        for i, grid in enumerate(self.grids):  # one pool per grid list entry: key by position
            indices[i] = (grid.src_idx, grid.dst_idx)
            groups.append(_Keyed(grid.group, i))
        return lower_groups(self.src_rank, self.dst_rank, groups, indices).batches

    @cached_property
    def num_descriptors(self) -> int:
        return sum(grid.num_descriptors for grid in self.grids)

    @cached_property
    def num_runs(self) -> int:
        return sum(grid.num_runs for grid in self.grids)

    @cached_property
    def total_nbytes(self) -> int:
        return sum(grid.total_nbytes for grid in self.grids)

    def __repr__(self) -> str:
        return (
            f"GridPlan({self.src_rank} -> {self.dst_rank}, {len(self.grids)} grid(s), "
            f"{self.num_runs} runs, {self.total_nbytes} bytes)"
        )


class _Keyed:
    """A unit group whose ``pool`` is the grid's position, so that two grids of one pool
    (never made by the planner, but legal here) lower with their own index lists."""

    def __init__(self, group: UnitGroup, key: int) -> None:
        self.units, self.src_base, self.dst_base = group.units, group.src_base, group.dst_base
        self.shape, self.pool = group.shape, key
