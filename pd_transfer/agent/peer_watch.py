"""Heartbeats to every session, and the peers found lost.

Each timer tick, a session in a state that heartbeats gets one once per
``heartbeat_interval_s``, telling the peer the longest stall of this loop of
late; a peer that is gone (its connection, which ZeroMQ and the kernel's
keepalive watch, stayed down longer than one interval, or its process on
this host ended) or silent for longer than it may be (the
heartbeat limit, or ``slow_peer_limit_s`` where its process on this host
runs or its watched connection is up:
:func:`~pd_transfer.agent.liveness.why_lost`) is lost: its channel closes and
the callback it was watched with learns why, once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pd_transfer.agent.liveness import LoopStalls, why_lost
from pd_transfer.protocol import Heartbeat, SessionState

if TYPE_CHECKING:
    from pd_transfer.agent.channels import Channel
    from pd_transfer.agent.observe import Observer
    from pd_transfer.config.sidecar import SidecarConfig

log = logging.getLogger("pd_transfer.agent.sidecar")

_HEARTBEAT_STATES = {
    SessionState.GREETED,
    SessionState.REGISTERING,
    SessionState.REGISTERED,
    SessionState.ACCEPTED,
    SessionState.REJECTED,
}


class PeerWatch:
    """The sessions a sidecar watches, and their heartbeats."""

    def __init__(self, config: SidecarConfig, stalls: LoopStalls, observe: Observer) -> None:
        self.config = config
        self.stalls = stalls
        self.observe = observe
        self._watched: list[tuple[Channel, Callable[[str], None]]] = []
        self._heartbeat_seq = itertools.count(1)

    def watch(self, channel: Channel, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(why)`` once ``channel``'s peer is lost: silent for longer than
        it may be (:func:`~pd_transfer.agent.liveness.why_lost`), or its connection down
        (a peer process that died closed it) for longer than one interval."""
        self._watched.append((channel, on_lost))

    def watch_once(self, channel: Channel, on_lost: Callable[[str], None]) -> None:
        """:meth:`watch` ``channel`` unless it is watched already."""
        if not any(ch is channel for ch, _ in self._watched):
            self.watch(channel, on_lost)

    def _lost(self, channel: Channel, on_lost: Callable[[str], None], why: str) -> None:
        self.observe.lost(channel.peer_rank or channel.label, why, channel)
        log.warning("peer %s lost: %s", channel.label, why)
        on_lost(why)

    async def tick(self, now: float) -> None:
        """Find the lost peers, and send the heartbeats that are due."""
        interval = self.config.heartbeat_interval_s
        limit = interval * self.config.heartbeat_misses
        for channel, on_lost in list(self._watched):
            if channel.closed:
                self._watched.remove((channel, on_lost))
                continue
            why = why_lost(channel, now, interval, limit, self.stalls, self.config.slow_peer_limit_s)
            if why:
                self._watched.remove((channel, on_lost))
                channel.close()
                self._lost(channel, on_lost, why)
                continue
            if channel.session.state in _HEARTBEAT_STATES and now - channel.last_beat_s >= interval:
                channel.last_beat_s = now
                await self._beat(channel, interval)

    async def _beat(self, channel: Channel, interval: float) -> None:
        try:
            # bounded: a peer that stops reading fills ZeroMQ's send queue;
            # its heartbeat is skipped (and it is soon lost), the timers go on
            async with asyncio.timeout(interval):
                await channel.send(
                    Heartbeat(
                        agent_id=self.config.agent_id,
                        sequence=next(self._heartbeat_seq),
                        sent_unix_s=time.time(),
                        stalled_s=self.stalls.longest_s(),
                    )
                )
        except Exception as err:
            log.debug("heartbeat to %s failed: %s", channel.label, err)
