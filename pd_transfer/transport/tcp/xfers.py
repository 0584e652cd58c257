"""Transfers on the wire, at both ends: a sender's write in flight and how the
receiver's replies settle it; a receiver's transfers landing and the ones it refused.

Both tcp senders (the plain link of :mod:`~pd_transfer.transport.tcp.link`
and the ZeroMQ one of :mod:`~pd_transfer.transport.zmq.transport`) number
their writes (``xfer``) and their chunks (``seq``); the receiver answers each
chunk with an ``ack``, each transfer with ``done`` or ``fail``
(:mod:`~pd_transfer.transport.tcp.frames`). :func:`settle` applies one reply
to the write it names; it runs on the event loop. On the receiving side
(the tcp connection, the ZeroMQ receiver) :class:`Incoming` counts each
transfer's chunks until its ``end`` and remembers the transfers it refused
(their later frames are dropped), both bounded.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.tcp.frames import Ack, EndHeader, Fail, XferDone

MAX_OPEN_XFERS = 4096
MAX_REMEMBERED_FAILURES = 4096


class Xfer:
    """One write in flight on a link: its unacked chunks and its final answer."""

    def __init__(self, xfer_id: int, room: str, generation: int = 0) -> None:
        self.xfer_id = xfer_id
        self.room = room
        self.generation = generation
        self.unacked: dict[int, int] = {}  # chunk seq -> nbytes
        self.result: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.conn_id: int | None = None  # the connection its first chunk went out on
        self.abandoned = False  # the writer stopped waiting: skip its jobs


def settle(xfers: Mapping[int, Xfer], reply: Ack | XferDone | Fail, peer_id: str) -> int | None:
    """Apply ``reply`` to the write it names; return the window credit an ack gives back
    (None when there is none to give back)."""
    xfer = xfers.get(reply.xfer)
    if xfer is None:
        return None  # a reply for a write that was abandoned (its caller timed out)
    if isinstance(reply, Ack):
        return xfer.unacked.pop(reply.seq, None)
    if xfer.result.done():
        return None
    if isinstance(reply, XferDone):
        xfer.result.set_result(reply.nbytes)
    else:
        xfer.result.set_exception(
            TransportError(f"{peer_id} refused room {xfer.room or '-'}: {reply.text}", code=reply.reason())
        )
    return None


@dataclass
class XferProgress:
    """What landed of one incoming transfer so far."""

    chunks: int = 0
    nbytes: int = 0
    landing: set = field(default_factory=set)  # scatters of it still running (ZeroMQ receiver)


class Incoming:
    """A receiver's incoming transfers, keyed by ``(peer, xfer)`` (``peer``: the ZeroMQ
    identity, or None on a connection of its own), and those it refused."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._open: OrderedDict[tuple[Hashable, int], XferProgress] = OrderedDict()
        self._failed: OrderedDict[tuple[Hashable, int], None] = OrderedDict()

    def refused(self, peer: Hashable, xfer: int) -> bool:
        """Was this transfer refused (its later frames are dropped)?"""
        return (peer, xfer) in self._failed

    def progress(self, peer: Hashable, xfer: int, where: str) -> XferProgress:
        """The transfer's progress, opened at its first chunk (``where`` names the
        receiver in the log)."""
        progress = self._open.get((peer, xfer))
        if progress is None:
            if len(self._open) >= MAX_OPEN_XFERS:
                # a sender that vanished mid-transfer never sends its end: forget the
                # oldest open transfer (should it resume, its end reports it incomplete)
                (_, stale), _ = self._open.popitem(last=False)
                self.log.warning("%s: dropped stale transfer %d", where, stale)
            progress = self._open[(peer, xfer)] = XferProgress()
        return progress

    def end(self, peer: Hashable, xfer: int) -> XferProgress:
        """The transfer ends: its progress (empty if no chunk of it landed)."""
        return self._open.pop((peer, xfer), XferProgress())

    def refuse(self, peer: Hashable, xfer: int) -> None:
        self._open.pop((peer, xfer), None)
        self._failed[(peer, xfer)] = None
        while len(self._failed) > MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)


def check_complete(progress: XferProgress, header: EndHeader) -> None:
    """Raise TRANSFER_INCOMPLETE unless every chunk the sender counted landed."""
    if (progress.chunks, progress.nbytes) != (header.num_chunks, header.nbytes):
        raise TransportError(
            f"room {header.room}: {progress.chunks} chunk(s) / "
            f"{progress.nbytes} bytes landed, sender sent "
            f"{header.num_chunks} / {header.nbytes}",
            code=Reason.TRANSFER_INCOMPLETE,
        )
