"""One write in flight on a sender link, and how the receiver's replies settle it.

Both tcp senders (the plain link of :mod:`~pd_transfer.transport.tcp.link`
and the ZeroMQ one of :mod:`~pd_transfer.transport.zmq.transport`) number
their writes (``xfer``) and their chunks (``seq``); the receiver answers each
chunk with an ``ack``, each transfer with ``done`` or ``fail``
(:mod:`~pd_transfer.transport.tcp.frames`). :func:`settle` applies one reply
to the write it names; it runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from pd_transfer.errors import TransportError
from pd_transfer.transport.tcp.frames import Ack, Done, Fail


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


def settle(xfers: Mapping[int, Xfer], reply: Ack | Done | Fail, peer_id: str) -> int | None:
    """Apply ``reply`` to the write it names; return the window credit an ack gives back
    (None when there is none to give back)."""
    xfer = xfers.get(reply.xfer)
    if xfer is None:
        return None  # a reply for a write that was abandoned (its caller timed out)
    if isinstance(reply, Ack):
        return xfer.unacked.pop(reply.seq, None)
    if xfer.result.done():
        return None
    if isinstance(reply, Done):
        xfer.result.set_result(reply.nbytes)
    else:
        xfer.result.set_exception(
            TransportError(f"{peer_id} refused room {xfer.room or '-'}: {reply.text}", code=reply.reason())
        )
    return None
