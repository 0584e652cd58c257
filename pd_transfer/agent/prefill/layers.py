"""The layers announced of a streamed chunk (``layer_ready``), and a rank's span of them.

Pure bookkeeping that a prefill room holds (:mod:`.records`) and its writes read
(:mod:`.streaming`, which states the rules of layer-wise streaming).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pd_transfer.errors import PdTransferError, Reason

if TYPE_CHECKING:
    from pd_transfer.layout.geometry import RankGeometry


@dataclass
class ChunkLayers:
    """The announcement state of one streamed chunk."""

    span: frozenset[int]  # every layer id of this rank
    ready: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.ready >= self.span

    def announce(self, room: int, layer_id: int) -> None:
        if layer_id not in self.span:
            low, high = min(self.span, default=0), max(self.span, default=-1)
            raise PdTransferError(
                f"room {room}: layer {layer_id} is not one of this rank's layers "
                f"({len(self.span)} layers, ids {low}..{high})",
                code=Reason.BAD_FIELD,
                hint="announce the layer ids of this rank's pipeline span",
            )
        self.ready.add(layer_id)

    def pending(self, sent: set[int]) -> list[int]:
        """Announced layers not yet sent to one decode target, in layer order."""
        return sorted(self.ready - sent)


def span_of(geometry: RankGeometry) -> frozenset[int]:
    """Every layer id a rank's registered views carry (its pipeline span)."""
    return frozenset(v.layer_id for v in geometry.views if v.layer_id is not None)


def latest_streamed(chunks: list[ChunkLayers | None], room: int) -> ChunkLayers:
    """The chunk a ``layer_ready`` refers to: the room's latest streamed chunk."""
    if chunks and chunks[-1] is not None:
        return chunks[-1]
    raise PdTransferError(
        f"room {room}: layer_ready without a streamed chunk to announce",
        code=Reason.UNKNOWN_ROOM,
        hint="call send(..., stream=True) for the chunk first",
    )
