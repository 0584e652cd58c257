"""The sidecar's HTTP port: ``/metrics``, ``/healthz``, ``/readyz``, ``/status``, and
the operations runbook by section at ``/runbooks/<name>`` (what the alerts link to).

A deliberately small HTTP/1.1 server on asyncio streams (GET only, one
request per connection, bounded request size), so the sidecar needs no web
framework. ``/healthz`` answers from the event loop itself: if it answers,
the loop is responsive. ``/readyz`` is 200 only when the worker registered and
every configured peer is accepted; otherwise 503 with the reasons as JSON.
``/runbooks/`` lists the runbook's sections; a name that is not one of them is a
404 (:mod:`pd_transfer.observability.runbooks` looks names up, never turns them into paths).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pd_transfer import __version__
from pd_transfer.config.addresses import dialable_host
from pd_transfer.observability import runbooks

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

_MAX_REQUEST_NBYTES = 8192


class HttpServer:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: Callable[[], bytes],
        ready: Callable[[], tuple[bool, dict[str, Any]]],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.host, self.port = host, port
        self._metrics, self._ready, self._status = metrics, ready, status
        self._server: asyncio.AbstractServer | None = None
        self.address = ""
        self.dial_address = ""  # address, with a wildcard host as loopback (the ready file)

    async def start(self) -> str:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, limit=_MAX_REQUEST_NBYTES
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"http://{host}:{port}"
        dial = dialable_host(host)
        self.dial_address = f"http://{f'[{dial}]' if ':' in dial else dial}:{port}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5.0):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path = _request_line(head)
            status, content_type, body = self._route(method, path)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, content_type, body = 400, "text/plain", b"bad request\n"
        except Exception:  # a bug must not take the port down
            log.exception("http: request failed")
            status, content_type, body = 500, "text/plain", b"internal error\n"
        reason = {
            200: "OK",
            400: "Bad Request",
            404: "Not Found",
            405: "Method Not Allowed",
            500: "Internal Server Error",
            503: "Service Unavailable",
        }[status]
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nX-Content-Type-Options: nosniff\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method != "GET":
            return 405, "text/plain", b"only GET\n"
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, self._metrics()
        if path == "/healthz":
            return 200, "application/json", b'{"status": "ok"}\n'
        if path == "/readyz":
            ready, detail = self._ready()
            return (200 if ready else 503), "application/json", _json(detail)
        if path == "/status":
            return 200, "application/json", _json(self._status())
        if path == "/runbooks" or path.startswith("/runbooks/"):
            return _runbook(path.removeprefix("/runbooks").removeprefix("/"))
        return 404, "text/plain", b"not found: try /metrics /healthz /readyz /status /runbooks/\n"


def _request_line(head: bytes) -> tuple[str, str]:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(line)
    return parts[0], parts[1]


_TEXT = "text/plain; charset=utf-8"


def _runbook(name: str) -> tuple[int, str, bytes]:
    """Section ``name`` of the runbook, or (``name`` empty) the list of its sections."""
    where = f"pd-transfer {__version__}, docs/operations.md"
    if not name:
        listing = [f"{where}: the runbook's sections\n"]
        for entry in runbooks.runbook().values():
            listing.append(f"{'  ' * (entry.level - 1)}/runbooks/{entry.name}  {entry.title}")
        if len(listing) == 1:
            listing.append("(docs/operations.md is not installed with this sidecar)")
        return 200, _TEXT, ("\n".join(listing) + "\n").encode()
    section = runbooks.lookup(name)
    if section is None:
        known = f" {name!r}" if runbooks.NAME.fullmatch(name) else ""
        return 404, _TEXT, f"no runbook section{known}: see /runbooks/ for the list\n".encode()
    return 200, _TEXT, f"{section.text}\n-- {where}#{section.name}\n".encode()


def _json(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
