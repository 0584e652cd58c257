"""The decode sidecar's doorbells: one slot per room, and the rules that keep the
worker and this sidecar agreeing on how the room ended.

- ``arm``: at ``expect``, a slot and token for the room, returned to the worker;
  whichever way the room ends, :meth:`ended` runs (a room hook) and wakes it.
- ``writers``: once the sources are known, their writer numbers when every one
  of them rings this rank's doorbells (Verdict ``doorbell``, no integrity
  checksums to verify first); else the slot closes and the room ends through
  messages.
- ``landed``: before this sidecar fails a room it closes the slot, then looks:
  every writer having rung means the bytes landed, and the room succeeded.
- ``rung``: a poll or wait that reaches the sidecar counts a rung room
  successful before its Done arrives.

See :mod:`pd_transfer.memory.doorbell` for the slot and its memory order.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pd_transfer.errors import PdTransferError
from pd_transfer.memory.doorbell import AVAILABLE, MAX_WRITERS, Doorbells
from pd_transfer.protocol import RoomStatus

if TYPE_CHECKING:
    from pd_transfer.agent.decode.room import DecodeRoom, PrefillPeer
    from pd_transfer.agent.observe import Observer
    from pd_transfer.config.sidecar import SidecarConfig

log = logging.getLogger(__package__)


class RoomBells:
    def __init__(self, config: SidecarConfig, observe: Observer) -> None:
        self.observe = observe
        self.segment: Doorbells | None = None
        if config.doorbell and AVAILABLE:
            try:
                self.segment = Doorbells.create(config.agent_id)
            except (OSError, PdTransferError) as err:
                log.warning("decode: no doorbells (rooms end through messages only): %s", err)

    @property
    def name(self) -> str:
        """The segment's name, for Register ('' without doorbells)."""
        return self.segment.name if self.segment is not None else ""

    def arm(self, room: DecodeRoom) -> dict[str, str | int] | None:
        """Give ``room`` a slot; the ``doorbell`` entry of the worker's expect reply."""
        if self.segment is None:
            return None
        room.bell = self.segment.arm()
        room.on_end.append(lambda ended: self.ended(room))  # called with the room itself
        return {"segment": self.segment.name, "slot": room.bell[0], "token": room.bell[1]}

    def writers(self, room: DecodeRoom, peers: list[PrefillPeer | None]) -> dict[str, int]:
        """``{rank id: writer number}`` for ``room``'s source ``peers`` (PrefillPeer) when
        every one rings; otherwise none, and the slot closes at once."""
        if room.bell is None or self.segment is None:
            return {}
        if not 0 < len(peers) <= MAX_WRITERS or not all(
            p is not None and p.rings and p.integrity is None for p in peers
        ):
            self.segment.close_slot(*room.bell)
            return {}
        self.segment.set_writers(*room.bell, len(peers))
        return {p.rank_id: k for k, p in enumerate(peers) if p is not None}  # all are

    def landed(self, room: DecodeRoom) -> bool:
        """This sidecar is about to fail ``room``: close its slot; True when every writer
        had rung first (the bytes landed, the worker may know it: the room succeeded)."""
        live = self._live(room)
        return live is not None and live[0].close_slot(*live[1])

    def rung(self, room: DecodeRoom) -> bool:
        """Every writer of live ``room`` rang (it succeeded, Done or not)."""
        live = self._live(room)
        return live is not None and live[0].rung(*live[1])

    def _live(self, room: DecodeRoom) -> tuple[Doorbells, tuple[int, int]] | None:
        """The segment and slot of live ``room``, None when it has none."""
        if room.bell is None or room.terminal or self.segment is None:
            return None
        return self.segment, room.bell

    def ended(self, room: DecodeRoom) -> None:
        if self.segment is None or room.bell is None:  # an armed room has a slot
            return
        if room.status is RoomStatus.SUCCESS and self.segment.rung(*room.bell):
            self.observe.doorbell("rung")  # the worker sees the ring itself
            return
        self.segment.close_slot(*room.bell)
        self.observe.doorbell("closed")

    def close(self) -> None:
        if self.segment is not None:
            self.segment.segment.unlink()
            self.segment.close()
            self.segment = None
