"""Decode: telling a prefill instance which rooms a rejected decode rank refuses.

A prefill room learns its decode only from that decode's TransferRequest. When
the prefill instance rejects this decode rank, no request follows, and without
word the prefill room would wait in Bootstrapping until its
``bootstrap_timeout_s``. So the sessions of a rejected resolution stay open
until the next resolution of that address (after the backoff,
:mod:`pd_transfer.agent.retry`), and every room that fails on the rejection
sends its prefill ranks a :class:`~pd_transfer.protocol.RoomRefused` with
``peer_rejected`` and the whole mismatch text (to the ranks whose Hello offers
:data:`~pd_transfer.protocol.ROOM_REFUSAL`); the prefill rank fails its room
with that text (``PrefillSide._on_refusal``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pd_transfer.agent.decode import retire
from pd_transfer.errors import Reason
from pd_transfer.protocol import ROOM_REFUSAL, RoomRefused
from pd_transfer.wire.fields import clip_text

if TYPE_CHECKING:
    from pd_transfer.agent.decode.room import PrefillInstance, PrefillPeer

log = logging.getLogger(__name__)


class RejectedSessions:
    """Per bootstrap address, the open sessions of its last rejected resolution."""

    def __init__(self, spawn: Callable[..., Any], verdict_wait_s: float) -> None:
        self._spawn = spawn
        self._verdict_wait_s = verdict_wait_s  # a rank whose verdict is still on its way
        self._by_address: dict[str, PrefillInstance] = {}

    def keep(self, bootstrap: str, instance: PrefillInstance) -> None:
        """``instance`` was rejected: keep its sessions to tell its ranks about rooms."""
        self.drop(bootstrap)
        self._by_address[bootstrap] = instance

    def drop(self, bootstrap: str) -> None:
        """Close the kept sessions of ``bootstrap`` (a new resolution replaces them)."""
        instance = self._by_address.pop(bootstrap, None)
        if instance is not None:
            self._spawn(retire.close_sessions(instance))

    def drop_all(self) -> None:
        for bootstrap in list(self._by_address):
            self.drop(bootstrap)

    def refuse_room(self, bootstrap: str, room: int, text: str) -> None:
        """Tell every rank of ``bootstrap``'s rejecting instance that ``room`` fails with ``text``."""
        instance = self._by_address.get(bootstrap)
        if instance is None:
            return
        refused = RoomRefused(room=room, reason=Reason.PEER_REJECTED, reason_text=clip_text(text))
        for peer in instance.peers.values():
            if not peer.channel.closed:
                self._spawn(self._send(peer, refused), room=str(room), peer=peer.rank_id)

    async def _send(self, peer: PrefillPeer, refused: RoomRefused) -> None:
        """Once ``peer``'s own verdict arrived (a session allows RoomRefused after a rejection),
        if its Hello offered :data:`ROOM_REFUSAL`."""
        try:
            async with asyncio.timeout(self._verdict_wait_s):
                verdict = await asyncio.shield(peer.verdict)
            hello = peer.channel.session.their_hello
            if not verdict.accepted and hello is not None and ROOM_REFUSAL in hello.capabilities.features:
                await peer.channel.send(refused)
        except Exception as err:  # no verdict, or the peer went away: its room ends at its timeout
            log.debug("decode: cannot tell %s that room %d is refused: %r", peer.rank_id, refused.room, err)
