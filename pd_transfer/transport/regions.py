"""Mapped regions as the data plane sees them: 1-D uint8 CPU memory.

A region is passed around as a torch uint8 tensor (or a numpy uint8 array);
the engine needs both views of the same bytes: torch for
``index_select(out=...)`` gathers, numpy for row scatters. :func:`map_regions`
validates the regions a plan uses and returns both, once per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from pd_transfer.errors import Reason, TransportError

RegionMemory = torch.Tensor | np.ndarray
Regions = Mapping[str, RegionMemory]


@dataclass
class Mapped:
    """One region as a numpy array and a torch tensor over the same bytes."""

    region_id: str
    array: np.ndarray
    tensor: torch.Tensor
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)
    _void: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.array.size

    def rows(self, row_nbytes: int) -> torch.Tensor:
        """The region as a 2-D tensor of ``row_nbytes``-byte rows (tail bytes left out)."""
        view = self._rows.get(row_nbytes)
        if view is None:
            num_rows = self.nbytes // row_nbytes
            view = self.tensor[: num_rows * row_nbytes].view(num_rows, row_nbytes)
            self._rows[row_nbytes] = view
        return view

    def void_rows(self, row_nbytes: int) -> np.ndarray:
        """The region as a 1-D numpy array of ``row_nbytes``-byte opaque items.

        ``np.put`` on such an array is one memmove per item: the fastest
        row scatter numpy or torch offer on CPU (torch's ``index_copy_``
        copies element by element and ran at a seventh of it here).
        """
        view = self._void.get(row_nbytes)
        if view is None:
            num_rows = self.nbytes // row_nbytes
            view = self.array[: num_rows * row_nbytes].view(np.dtype((np.void, row_nbytes)))
            self._void[row_nbytes] = view
        return view


def map_one(region_id: str, memory: RegionMemory, side: str) -> Mapped:
    """Validate one region and pair it with its other view."""
    if isinstance(memory, torch.Tensor):
        if memory.device.type != "cpu":
            raise TransportError(f"{side} region {region_id!r} lives on {memory.device}; this "
                                 f"engine copies CPU memory only", code=Reason.REGION_INVALID)
        _check_shape(region_id, side, memory.dtype == torch.uint8, memory.dim(),
                     memory.is_contiguous(), memory.dtype)
        return Mapped(region_id, memory.numpy(), memory)
    if isinstance(memory, np.ndarray):
        _check_shape(region_id, side, memory.dtype == np.uint8, memory.ndim,
                     memory.flags.c_contiguous, memory.dtype)
        if not memory.flags.writeable:  # torch wants writable memory; only sources may be read-only
            return Mapped(region_id, memory, torch.from_numpy(memory.copy()))
        return Mapped(region_id, memory, torch.from_numpy(memory))
    raise TransportError(f"{side} region {region_id!r} is a {type(memory).__name__}, not a "
                         f"torch tensor or numpy array", code=Reason.REGION_INVALID)


def _check_shape(region_id: str, side: str, is_uint8: bool, ndim: int, contiguous: bool,
                 dtype: object) -> None:
    if not (is_uint8 and ndim == 1 and contiguous):
        raise TransportError(f"{side} region {region_id!r} must be a contiguous 1-D uint8 "
                             f"buffer, got dtype {dtype}, {ndim} dim(s)"
                             f"{'' if contiguous else ', not contiguous'}",
                             code=Reason.REGION_INVALID)


def map_regions(regions: Regions, region_ids: Iterable[str], side: str) -> dict[str, Mapped]:
    """Map the named regions; raise UNKNOWN_REGION naming every one that is missing."""
    wanted = sorted(set(region_ids))
    missing = [r for r in wanted if r not in regions]
    if missing:
        raise TransportError(f"{side} region(s) {missing} are not mapped "
                             f"({len(regions)} region(s) known)", code=Reason.UNKNOWN_REGION)
    return {r: map_one(r, regions[r], side) for r in wanted}


def sizes_of(mapped: Mapping[str, Mapped]) -> dict[str, int]:
    return {region_id: m.nbytes for region_id, m in mapped.items()}
