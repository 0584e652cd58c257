"""Mapped regions as the data plane sees them: 1-D uint8 CPU memory.

A region is passed around as a torch uint8 tensor or a numpy uint8 array
(the same bytes either way; torch is never imported here, a tensor can only
exist once its caller loaded it); the engines work on numpy views of it, opaque
rows of ``g`` bytes in particular (:meth:`Mapped.void_rows`).
:func:`map_regions` validates the regions a plan uses; :class:`MappedCache`
keeps the result for regions that stay registered.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import numpy as np

from pd_transfer.errors import Reason, TransportError

if TYPE_CHECKING:
    import torch

RegionMemory = Union["torch.Tensor", np.ndarray]
Regions = Mapping[str, "RegionMemory | Mapped"]


@dataclass
class Mapped:
    """One validated region as a flat numpy uint8 array, with cached row views."""

    region_id: str
    array: np.ndarray
    _void: dict[int, np.ndarray] = field(default_factory=dict)
    address: int = field(init=False)  # of the first byte (the native copy loop's base)

    def __post_init__(self) -> None:
        self.address = self.array.__array_interface__["data"][0]

    @property
    def nbytes(self) -> int:
        return self.array.size

    def void_rows(self, row_nbytes: int) -> np.ndarray:
        """The region as a 1-D numpy array of ``row_nbytes``-byte opaque items.

        ``np.take``/``np.put`` on such an array move one row with one memmove:
        the fastest row gather and scatter numpy or torch offer on CPU (torch's
        ``index_copy_`` copies element by element and ran at a seventh of it).
        """
        view = self._void.get(row_nbytes)
        if view is None:
            num_rows = self.nbytes // row_nbytes
            view = self.array[: num_rows * row_nbytes].view(np.dtype((np.void, row_nbytes)))
            self._void[row_nbytes] = view
        return view


def on_device(memory: RegionMemory | Mapped) -> bool:
    """Whether ``memory`` is a torch tensor outside host memory (CUDA)."""
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is loaded
    return torch is not None and isinstance(memory, torch.Tensor) and memory.device.type != "cpu"


def map_one(region_id: str, memory: RegionMemory | Mapped, side: str) -> Mapped:
    """Validate one region and view it as numpy (a Mapped passes through)."""
    if isinstance(memory, Mapped):
        return memory
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is loaded
    if torch is not None and isinstance(memory, torch.Tensor):
        if memory.device.type != "cpu":
            raise TransportError(
                f"{side} region {region_id!r} lives on {memory.device}; this engine copies CPU memory only",
                code=Reason.REGION_INVALID,
            )
        _check_shape(
            region_id, side, memory.dtype == torch.uint8, memory.dim(), memory.is_contiguous(), memory.dtype
        )
        return Mapped(region_id, memory.numpy())
    if isinstance(memory, np.ndarray):
        _check_shape(
            region_id, side, memory.dtype == np.uint8, memory.ndim, memory.flags.c_contiguous, memory.dtype
        )
        if side == "destination" and not memory.flags.writeable:
            raise TransportError(f"destination region {region_id!r} is read-only", code=Reason.REGION_INVALID)
        return Mapped(region_id, memory)
    raise TransportError(
        f"{side} region {region_id!r} is a {type(memory).__name__}, not a torch tensor or numpy array",
        code=Reason.REGION_INVALID,
    )


def _check_shape(
    region_id: str, side: str, is_uint8: bool, ndim: int, contiguous: bool, dtype: object
) -> None:
    if not (is_uint8 and ndim == 1 and contiguous):
        raise TransportError(
            f"{side} region {region_id!r} must be a contiguous 1-D uint8 "
            f"buffer, got dtype {dtype}, {ndim} dim(s)"
            f"{'' if contiguous else ', not contiguous'}",
            code=Reason.REGION_INVALID,
        )


def map_regions(regions: Regions, region_ids: Iterable[str], side: str) -> dict[str, Mapped]:
    """Map the named regions; raise UNKNOWN_REGION naming every one that is missing."""
    wanted = sorted(set(region_ids))
    missing = [r for r in wanted if r not in regions]
    if missing:
        raise TransportError(
            f"{side} region(s) {missing} are not mapped ({len(regions)} region(s) known)",
            code=Reason.UNKNOWN_REGION,
        )
    return {r: map_one(r, regions[r], side) for r in wanted}


def sizes_of(mapped: Mapping[str, Mapped]) -> dict[str, int]:
    return {region_id: m.nbytes for region_id, m in mapped.items()}


class MappedCache:
    """Mapped views of regions that stay registered, rebuilt only when an entry changes.

    A sidecar passes the same region tensors with every write; validating
    and re-viewing 128 of them costs more than copying a 1-page room.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[RegionMemory | Mapped, Mapped]] = {}

    def map(self, regions: Regions, region_ids: Iterable[str], side: str) -> dict[str, Mapped]:
        out: dict[str, Mapped] = {}
        missing: list[str] = []
        for region_id in region_ids:
            if region_id in out:
                continue
            memory = regions.get(region_id)
            if memory is None:
                missing.append(region_id)
                continue
            entry = self._entries.get(region_id)
            if entry is None or entry[0] is not memory:
                entry = self._entries[region_id] = (memory, map_one(region_id, memory, side))
            out[region_id] = entry[1]
        if missing:
            raise TransportError(
                f"{side} region(s) {sorted(set(missing))} are not mapped ({len(regions)} region(s) known)",
                code=Reason.UNKNOWN_REGION,
            )
        return out

    def clear(self) -> None:
        self._entries.clear()

    def destination(self, lookup: Callable[[str], RegionMemory | None], region_id: str) -> Mapped:
        """The region a receiver's ``lookup`` finds for ``region_id``, mapped (once per
        registered memory); UNKNOWN_REGION when it finds none."""
        memory = lookup(region_id)
        if memory is None:
            raise TransportError(f"region {region_id!r} is not registered here", code=Reason.UNKNOWN_REGION)
        entry = self._entries.get(region_id)
        if entry is None or entry[0] is not memory:
            entry = self._entries[region_id] = (memory, map_one(region_id, memory, "destination"))
        return entry[1]
