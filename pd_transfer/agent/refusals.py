"""Nothing listens at an address: every connection to it refused for a while.

A ZeroMQ socket that connects to an address where no process listens retries
quietly forever; whoever waits for an answer waits for its whole deadline.
The kernel, though, says so at once: each try is refused (a tcp RST, or no
socket file behind an ``ipc://`` path), and the socket's monitor reports a
``CONNECT_RETRIED``. :func:`first_answer_or_refusal` runs a request against
that evidence: when every try has been refused for ``limit_s`` and none got
through, it fails with the address and how long, instead of waiting on.

A decode sidecar resolving a room's prefill instance uses it: the room came
from that prefill, so a refused address means its sidecar is not running
(it died, or its host restarted without it), and the room fails in seconds.
A listener that is merely slow (starved, stopped) still has its kernel
accept the connection, which is never taken for a refusal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pd_transfer.errors import PdTransferError, Reason

T = TypeVar("T")

#: the shortest refusal taken for "nothing listens": a prefill rank 0 binds its bootstrap
#: address when its worker first registers, and a decode's claim may come a moment before
MIN_REFUSED_S = 5.0

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED


def watch_refusals(socket: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    """The monitor :func:`first_answer_or_refusal` reads; made before ``socket`` connects."""
    return socket.get_monitor_socket(_EVENTS)


async def _refused(monitor: zmq.asyncio.Socket, address: str, limit_s: float, what: str) -> None:
    """Return never once a connection got through; raise once every try was refused ``limit_s``."""
    first_refusal: float | None = None
    tries = 0
    while True:
        wait_s = 0.25 if first_refusal is None else max(0.0, first_refusal + limit_s - time.monotonic())
        if await monitor.poll(wait_s * 1000):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                await asyncio.Future()  # something listens: the request's own deadline rules
            tries += 1
            first_refusal = first_refusal or time.monotonic()
        if first_refusal is not None and time.monotonic() - first_refusal >= limit_s:
            raise PdTransferError(
                f"{what} {address}: nothing listens there (every connection refused for "
                f"{time.monotonic() - first_refusal:.1f} s, {tries} tries)",
                code=Reason.BOOTSTRAP_FAILED,
                hint="the process serving that address is not running: check it and its host",
            )


async def first_answer_or_refusal(
    request: Awaitable[T], monitor: zmq.asyncio.Socket, address: str, limit_s: float, what: str
) -> T:
    """``request``'s result, or the refusal error once ``address`` refused every try for
    ``limit_s`` (at least :data:`MIN_REFUSED_S`; ``request`` is then cancelled). Closes
    ``monitor``."""
    asked = asyncio.ensure_future(request)
    watch = asyncio.ensure_future(_refused(monitor, address, max(limit_s, MIN_REFUSED_S), what))
    try:
        await asyncio.wait({asked, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not asked.done():
            watch.result()  # the watch ended first, which it only does by raising the refusal
        return asked.result()
    finally:
        for task in (asked, watch):
            task.cancel()
        await asyncio.gather(asked, watch, return_exceptions=True)
        monitor.close(linger=0)
