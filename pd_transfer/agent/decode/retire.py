"""Decode: closing the sessions of prefill instances that are no longer used.

Sessions are released, never only replaced. A failed resolution (a
rejection, no verdict in time, a rank lost meanwhile) closes the sessions it
opened at once; until it ends, they are its own. A lost
instance (one of its ranks went silent) is resolved anew on the next
``expect``, with new sessions to every rank; its old sessions to the
surviving ranks stay open only while something can still arrive on them:
while a room that used the instance is live, and until each surviving source
of an ended room answered (Done or AbortAck) or ``abort_drain_timeout_s``
passed since the loss. Then each gets a Close, on which the prefill rank
releases that session's link (unmapping the decode segments it mapped); a
Close that gets lost ends the same way, once prefill misses its heartbeats.

Called from the sidecar's timer tick; the role logic stays in :mod:`.side`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from pd_transfer.agent.auth import REFUSAL_LINGER_MS
from pd_transfer.agent.channels import CLOSE_SEND_TIMEOUT_S
from pd_transfer.agent.decode.room import DecodeRoom
from pd_transfer.protocol import Close

if TYPE_CHECKING:
    from pd_transfer.agent.decode.room import PrefillInstance
    from pd_transfer.agent.retry import Backoff
    from pd_transfer.agent.rooms import Room
    from pd_transfer.config.sidecar import SidecarConfig

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]


class Resolutions(Protocol):
    """What retiring reads and prunes of the decode side's prefill instances."""

    retired: list[PrefillInstance]  # lost: sessions to close once quiet
    instances: dict[str, asyncio.Task[PrefillInstance]]  # by bootstrap address, resolved or resolving
    backoffs: dict[str, Backoff]  # by bootstrap address

    @property
    def config(self) -> SidecarConfig: ...


async def close_sessions(instance: PrefillInstance) -> None:
    """Close every session of ``instance`` still open, saying so first."""
    for peer in instance.peers.values():
        if peer.channel.closed:
            continue
        try:
            async with asyncio.timeout(CLOSE_SEND_TIMEOUT_S):
                await peer.channel.send(Close(reason_text="decode released this session"))
        except Exception as err:  # unreachable or never authenticated: close anyway
            log.debug("decode: no Close to %s: %s", peer.rank_id, err)
        peer.channel.close(linger_ms=REFUSAL_LINGER_MS)  # let the Close leave first


def release_retired(side: Resolutions, rooms: Collection[Room], spawn: Spawn, now_s: float) -> None:
    """Close the sessions of lost instances nothing can still arrive on (``rooms``: every
    room of the table; ``spawn`` starts the closes)."""
    for instance in list(side.retired):
        if instance.resolving:
            continue  # a rank lost while resolving: the resolution fails and closes them
        state = rooms_state(rooms, instance)
        if state == "live" or (
            state == "pending" and now_s - instance.lost_s < side.config.abort_drain_timeout_s
        ):
            continue
        side.retired.remove(instance)
        log.info("decode: closing the sessions of lost prefill instance %s", instance.bootstrap)
        spawn(close_sessions(instance))
    for address, task in list(side.instances.items()):
        # failed or lost resolutions of unconfigured addresses: the next expect resolves
        # again (a failed one once its backoff has passed: side.backoffs keeps its count)
        if (
            task.done()
            and address not in side.config.prefill_bootstraps
            and _over(side, address, task, now_s)
        ):
            del side.instances[address]


def _over(side: Resolutions, address: str, task: asyncio.Task[PrefillInstance], now_s: float) -> bool:
    if task.cancelled():
        return True
    if task.exception() is not None:
        return side.backoffs[address].due(now_s)
    return task.result().lost


def rooms_state(rooms: Iterable[Room], instance: PrefillInstance) -> str:
    """'live' while a room uses ``instance``; 'pending' while a surviving source of an
    ended room has not answered (Done or AbortAck); else 'quiet'."""
    state = "quiet"
    for room in rooms:
        if not isinstance(room, DecodeRoom) or room.instance is not instance:
            continue
        if not room.terminal:
            return "live"
        if not set(room.sources) - instance.lost_ranks <= room.acks | room.done_from:
            state = "pending"
    return state
