"""Running a sidecar: event loop choice and signal handling.

uvloop when installed (asyncio otherwise). The first SIGINT/SIGTERM asks the
sidecar to drain: in-flight rooms finish or fail with a reason; a second one
forces the exit. Neither can hang: once the service returns (or a forced stop
was asked for) a watchdog ends the process if it has not exited within
``EXIT_GRACE_S`` (a thread stuck in a socket call would otherwise hold the
interpreter's exit).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Protocol

log = logging.getLogger(__name__)

EXIT_GRACE_S = 10.0
EXIT_STUCK = 3


class Stoppable(Protocol):
    async def run(self) -> None: ...
    def request_stop(self, *, force: bool) -> None: ...


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_until_stopped(service: Stoppable) -> None:
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        force = signals_seen > 1
        log.info(
            "signal %s: %s",
            signal.Signals(signum).name,
            "forcing exit" if force else "draining (send again to force)",
        )
        service.request_stop(force=force)
        if force:
            _watchdog(EXIT_STUCK)

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        loop.run_until_complete(service.run())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        _watchdog(0)  # the service is done: exiting must not wait on stuck threads


def _watchdog(code: int) -> None:
    def expire() -> None:
        log.warning("exit did not complete within %.0f s; ending the process (code %d)", EXIT_GRACE_S, code)
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(EXIT_GRACE_S, expire)
    timer.daemon = True
    timer.start()
