"""What a pool builder returns: the tensor views and the regions they live in.

Pure data; imports only ``pd_transfer.layout.views`` and ``.geometry``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pd_transfer.layout.geometry import Region
from pd_transfer.layout.views import TensorView


@dataclass(frozen=True)
class PoolViews:
    """Views of one pool (or several, once merged) and exactly their regions."""

    views: tuple[TensorView, ...] = ()
    regions: tuple[Region, ...] = ()

    def __add__(self, other: PoolViews) -> PoolViews:
        return PoolViews(self.views + other.views, self.regions + other.regions)

    @staticmethod
    def merge(parts: Iterable[PoolViews]) -> PoolViews:
        views: list[TensorView] = []
        regions: list[Region] = []
        for part in parts:
            views += part.views
            regions += part.regions
        return PoolViews(tuple(views), tuple(regions))
