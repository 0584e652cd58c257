"""Copying a :class:`~pd_transfer.layout.grids.GridPlan` with the native loop.

A small plan (a 1-page room) reaches the shm writer as grids: per unit group,
the index lists and the group's shape. This module turns each group into a
:class:`Program` once per link (every unit's region base address, and how far
the index offsets may reach before a piece leaves its region) and then copies
a room with one native call per grid, after an O(1) bounds check per grid:

Every piece of unit ``u`` at index offset ``x`` spans
``[base[u] + x + low, base[u] + x + high)``, where ``low`` and ``high`` are the
extremes of the group's positions and strided pieces. So all pieces of a grid
lie inside their regions exactly when ``min(x) >= max_u(-base[u] - low)`` and
``max(x) <= min_u(size[u] - base[u] - high)``: two numbers per side, computed
with the program. Worked example, Llama-3.1-8B TP 1 K of one layer in an NHD
pool of 64 pages: a page is 32 KiB, ``low = 0``, ``high = 32 KiB``, so the
page offset ``x`` must lie in ``[0, 63 * 32 KiB]`` on each side.

A program remembers the region objects it took addresses from and is rebuilt
when any of them is no longer the one registered (a region re-registered), so
an address is never used after its region was replaced. :func:`copy` returns
False, copying nothing, when a region is missing or a piece would leave its
region; the engine's full check then names the offender.

Imports numpy only; no asyncio, no zmq.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from operator import is_

import numpy as np

from pd_transfer.transport.copy import native_loop
from pd_transfer.transport.regions import Mapped, Regions, map_one


@dataclass(frozen=True)
class Program:
    """One unit group between two sets of mapped regions."""

    src_ids: tuple[str, ...]  # each unit's region, per side
    dst_ids: tuple[str, ...]
    src_memory: tuple  # the objects the addresses were taken from
    dst_memory: tuple
    mapped: tuple[Mapped, ...]  # kept so that every address stays mapped
    src_unit: np.ndarray  # absolute address of each unit's base
    dst_unit: np.ndarray
    src_reach: tuple[int, int]  # the index offsets allowed: (lowest, highest)
    dst_reach: tuple[int, int]

    def current(self, src_regions: Regions, dst_regions: Regions) -> bool:
        """Whether every region is still the object the addresses came from."""
        return all(map(is_, map(src_regions.get, self.src_ids), self.src_memory)) and all(
            map(is_, map(dst_regions.get, self.dst_ids), self.dst_memory)
        )


def build_program(group, src_regions: Regions, dst_regions: Regions) -> Program | None:
    """The program of ``group`` (a :class:`UnitGroup`); None when a region is missing."""
    shape = group.shape
    src_ids = tuple(u.src_region for u in group.units)
    dst_ids = tuple(u.dst_region for u in group.units)
    src_memory = tuple(m for r in src_ids if (m := src_regions.get(r)) is not None)
    dst_memory = tuple(m for r in dst_ids if (m := dst_regions.get(r)) is not None)
    if len(src_memory) != len(src_ids) or len(dst_memory) != len(dst_ids):
        return None
    mapped_src = [map_one(r, m, "source") for r, m in zip(src_ids, src_memory)]
    mapped_dst = [map_one(r, m, "destination") for r, m in zip(dst_ids, dst_memory)]
    reach = []
    for mapped, base, combo, stride in (
        (mapped_src, group.src_base, shape.combo_src, shape.src_stride),
        (mapped_dst, group.dst_base, shape.combo_dst, shape.dst_stride),
    ):
        last_piece = (shape.count - 1) * stride
        low = int(combo.min()) + min(0, last_piece)
        high = int(combo.max()) + max(0, last_piece) + shape.run_nbytes
        sizes = np.fromiter((m.nbytes for m in mapped), np.int64, len(mapped))
        reach.append((int((-base - low).max()), int((sizes - base - high).min())))
    return Program(
        src_ids,
        dst_ids,
        src_memory,
        dst_memory,
        (*mapped_src, *mapped_dst),
        np.fromiter((m.address for m in mapped_src), np.int64, len(mapped_src)) + group.src_base,
        np.fromiter((m.address for m in mapped_dst), np.int64, len(mapped_dst)) + group.dst_base,
        reach[0],
        reach[1],
    )


def copy(plan, src_regions: Regions, dst_regions: Regions, programs: dict) -> bool:
    """Copy every grid of ``plan`` in order; False (nothing copied) when a region is
    missing or a piece would leave its region. ``programs`` caches per unit group
    (a link's dict: the destination regions are the link's)."""
    work = []
    for grid in plan.grids:
        # keyed by identity (a group holds arrays, so it has no hash); the entry holds
        # the group, so its id is not reused while the entry lives
        group, program = programs.get(id(grid.group), (None, None))
        if group is not grid.group or not program.current(src_regions, dst_regions):
            program = build_program(grid.group, src_regions, dst_regions)
            if program is None:
                return False
            programs[id(grid.group)] = (grid.group, program)
        src_stride, dst_stride = grid.group.shape.index_strides
        src_x = [i * src_stride for i in grid.src_idx.tolist()]
        dst_x = [j * dst_stride for j in grid.dst_idx.tolist()]
        if (
            len(src_x) != len(dst_x)
            or src_x
            and not (_inside(src_x, program.src_reach) and _inside(dst_x, program.dst_reach))
        ):
            return False
        work.append((program, array("q", src_x), array("q", dst_x), grid.group.shape))
    total = plan.total_nbytes
    for program, src_at, dst_at, shape in work:  # every grid checked before the first byte
        native_loop.copy_grid(program.src_unit, program.dst_unit, src_at, dst_at, shape, total)
    return True


def _inside(offsets: list[int], reach: tuple[int, int]) -> bool:
    return reach[0] <= min(offsets) and max(offsets) <= reach[1]
