"""ZeroMQ's ZAP handler: which identity keys may connect to the control and bootstrap ports.

With ``identity_allow_file`` set (:mod:`pd_transfer.security.identity`), the
control and bootstrap sockets carry the ZAP domain
:data:`~pd_transfer.security.identity.IDENTITY_DOMAIN`, and libzmq asks this
handler about every CURVE handshake on them, after checking that the client
holds the secret half of the key it presents: a key on the allow-list is
accepted and its Z85 text becomes the connection's ``User-Id`` (every frame
carries it, and the gate checks the names claimed against it); any other key
is refused before a frame of the connection is read, and counted
(``pd_transfer_auth_failures_total{reason="identity_mismatch"}``). Sockets of
other domains (the CURVE data receiver) are accepted as before.

The handler is a REP socket at ZeroMQ's fixed ``inproc://zeromq.zap.01`` in the
sidecar's context, bound when the context is made, served by one task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import zmq
import zmq.asyncio
from zmq.utils import z85

from pd_transfer.errors import Reason
from pd_transfer.security.identity import IDENTITY_DOMAIN, Identity

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class ZapHandler:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        identities: Mapping[str, Identity],
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.identities = identities
        self.on_refused = on_refused
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)

    async def serve(self) -> None:
        try:
            while True:
                request = await self._socket.recv_multipart()
                await self._socket.send_multipart(self.answer(request))
        except zmq.ZMQError as err:  # the context is closing
            log.debug("ZAP handler stopped: %s", err)
        finally:
            self._socket.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request: 200 with the key as User-Id, or 400."""
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed request", b"", b""]
        version, request_id, domain, address, _routing_id, mechanism, *credentials = request
        if domain.decode(errors="replace") != IDENTITY_DOMAIN:
            return [version, request_id, b"200", b"OK", b"", b""]
        key = z85.encode(credentials[0]).decode() if mechanism == b"CURVE" and credentials else ""
        if key and key in self.identities:
            return [version, request_id, b"200", b"OK", key.encode(), b""]
        self.on_refused(Reason.IDENTITY_MISMATCH.value)
        log.warning(
            "identity: refused a connection from %s presenting %s: not in identity_allow_file",
            address.decode(errors="replace"),
            f"key {key[:8]}..." if key else f"no CURVE key ({mechanism.decode(errors='replace')})",
            extra={"reason": Reason.IDENTITY_MISMATCH.value},
        )
        return [version, request_id, b"400", b"identity key not listed", b"", b""]
