"""The tcp data plane as the sidecar's security configures it: which variant, which handshake.

Without CURVE keys the data plane is :class:`~pd_transfer.transport.tcp.transport.TcpTransport`
and :class:`~pd_transfer.transport.tcp.receiver.TcpReceiver` on plain sockets
(the fast path), authenticated by the shared secret when one is configured.
With CURVE keys it is the ZeroMQ variant
(:class:`~pd_transfer.transport.zmq.transport.ZmqTcpTransport`,
:class:`~pd_transfer.transport.zmq.receiver.ZmqTcpReceiver`), which ZeroMQ
encrypts, at about half the speed: the deployment asked for encryption.
Either receiver admits only the rooms the decode side expects, into their
own pages (``RoomPolicy.EXPECTED``).

The transport layer knows no security code (it may not import it); it runs
an :class:`~pd_transfer.transport.tcp.sockets.Authenticator` the agent gives it.
:class:`DataAuth` is that hook, built from the sidecar's :class:`Security`:
the same mutual HMAC-SHA256 challenge-response as on the control sockets
(:mod:`pd_transfer.security.handshake`), with the same nonce book, so a
prefill sidecar's data connection proves the secret before its first chunk,
and a decode receiver proves it back. Every refusal is counted in
``pd_transfer_auth_failures_total{reason}`` and logged, and raised to the
transport as a TransportError with the refusal's code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from pd_transfer.agent.auth import Security, security_of
from pd_transfer.agent.zmq_bounds import ConnectionWatch
from pd_transfer.errors import AuthError, ProtocolError, Reason, TransportError
from pd_transfer.security import ClientHandshake, ServerHandshake
from pd_transfer.security.handshake import derive_key, refusal
from pd_transfer.security.messages import AuthHello, AuthMessage, AuthProof, AuthResult, decode
from pd_transfer.transport.base import Transport
from pd_transfer.transport.receiver_rooms import RoomPolicy
from pd_transfer.transport.tcp.receiver import TcpReceiver
from pd_transfer.transport.tcp.sockets import FrameChannel
from pd_transfer.transport.tcp.transport import TcpTransport
from pd_transfer.transport.zmq.receiver import ZmqTcpReceiver
from pd_transfer.transport.zmq.transport import ZmqTcpTransport

if TYPE_CHECKING:
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.transport.regions import RegionMemory

log = logging.getLogger(__name__)

#: the ``socket`` label of the data receiver's ended connections
DATA_SOCKET = "data"


def tcp_transport(config: SidecarConfig, context: zmq.asyncio.Context) -> Transport:
    """The sending side: ZeroMQ with CURVE when a CURVE server key is expected, else plain."""
    security = security_of(context)
    if security.settings.curve_server_key:
        return ZmqTcpTransport(
            context,
            window_nbytes=config.max_inflight_nbytes,
            socket_options=security.curve_client,
        )
    return TcpTransport(
        window_nbytes=config.max_inflight_nbytes,
        streams=config.tcp_streams,
        auth=DataAuth(security) if security.enabled else None,
        handshake_timeout_s=security.handshake_timeout_s,
    )


def tcp_receiver(
    config: SidecarConfig,
    regions: Mapping[str, RegionMemory],
    context: zmq.asyncio.Context,
    on_bad_frame: Callable[[str], None] = lambda reason: None,
    on_closed: Callable[[str], None] = lambda socket: None,
) -> TcpReceiver | ZmqTcpReceiver:
    """The receiving side: ZeroMQ with CURVE when this sidecar has a CURVE key, else plain.
    ``on_bad_frame(reason)``: a frame or connection the receiver refused unread;
    ``on_closed("data")``: a data connection ended (the peer left, or was dropped)."""
    security = security_of(context)
    if security.settings.curve_keypair is not None:

        async def watch(socket: zmq.asyncio.Socket) -> None:
            address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            await ConnectionWatch(
                socket,
                DATA_SOCKET,
                f"data receiver {address}",
                on_closed=on_closed,
                on_bad_frame=on_bad_frame,
            ).run()

        return ZmqTcpReceiver(
            config.data_host,
            regions,
            port=config.data_port,
            context=context,
            socket_options=security.listening,
            policy=RoomPolicy.EXPECTED,
            watch=watch,
            on_bad_frame=on_bad_frame,
        )
    return TcpReceiver(
        config.data_host,
        regions,
        port=config.data_port,
        auth=DataAuth(security) if security.enabled else None,
        handshake_timeout_s=config.data_handshake_timeout_s,
        max_pending=config.max_pending_data_connections,
        on_bad_frame=on_bad_frame,
        on_closed=lambda: on_closed(DATA_SOCKET),
        policy=RoomPolicy.EXPECTED,
    )


class DataAuth:
    """:class:`~pd_transfer.transport.tcp.sockets.Authenticator` over a sidecar's secret."""

    def __init__(self, security: Security) -> None:
        secret = security.settings.secret
        if secret is None:
            raise ValueError("DataAuth needs a shared secret")
        self.security = security
        self._secret = secret
        self._key = derive_key(secret)

    def client(self, channel: FrameChannel, peer: str) -> None:
        security = self.security
        handshake = ClientHandshake(self._secret, security.agent_id, peer=f"data receiver {peer}")
        channel.send(handshake.hello())
        while not handshake.done:
            try:
                reply = handshake.receive(channel.recv())
            except AuthError as err:
                if err.reply is not None:
                    _try_send(channel, err.reply)  # tell the receiver why: it counts it too
                raise self._refused(err, "") from None
            except TransportError as err:
                raise self._refused(
                    AuthError(f"data receiver {peer}: {err.message}", code=err.code), ""
                ) from None
            if reply is not None:
                channel.send(reply)

    def server(self, first_frame: bytes, channel: FrameChannel, where: str) -> str:
        try:
            hello = self._decode(first_frame)
            if not isinstance(hello, AuthHello):
                raise refusal(Reason.AUTH_FAILED, f"a {hello.TAG} where a hello was expected")
            handshake = ServerHandshake(self._key, self.security.agent_id, hello, self.security.nonces)
            channel.send(handshake.challenge())
            answer = self._decode(channel.recv())
            if isinstance(answer, AuthResult) and not answer.accepted:
                raise AuthError(
                    f"{hello.agent_id} refused this sidecar's proof: "
                    f"{answer.reason_text or 'no reason given'}",
                    code=answer.reason or Reason.AUTH_FAILED,
                )
            if not isinstance(answer, AuthProof):
                raise refusal(Reason.AUTH_FAILED, f"a {answer.TAG} where a proof was expected")
            channel.send(handshake.verify(answer))
            return hello.agent_id
        except AuthError as err:
            if err.reply is not None:
                _try_send(channel, err.reply)
            raise self._refused(err, where) from None
        except TransportError as err:  # data frames mid-handshake, or a reply frame
            raise self._refused(AuthError(err.message, code=err.code), where) from None

    def unauthenticated(self, where: str) -> None:
        self.security.failed(
            AuthError(
                "a data connection sent a chunk before the authentication handshake",
                code=Reason.UNAUTHENTICATED,
            ),
            where,
        )

    def _decode(self, frame: bytes) -> AuthMessage:
        try:
            return decode(frame)
        except ProtocolError as err:
            raise refusal(Reason.AUTH_FAILED, f"malformed handshake frame: {err.message}") from None

    def _refused(self, err: AuthError, where: str) -> TransportError:
        self.security.failed(err, where)
        return TransportError(err.message, code=err.code, hint=err.hint)


def _try_send(channel: FrameChannel, frame: bytes) -> None:
    try:
        channel.send(frame)
    except OSError as err:
        log.debug("cannot tell the data peer why it was refused: %s", err)
