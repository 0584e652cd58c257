"""Authentication on the sidecar's sockets: the handshake driven over ZeroMQ.

The sidecar's ZeroMQ context is a :class:`SecureContext` carrying its
:class:`Security`, so every piece that opens a socket from it (a decode's
control channel, a rank-table request, the listening sockets) finds the
secret and the CURVE keys there, without passing them through each caller.
A plain context means security off, which is what unit tests use.

Listening sockets (ROUTER) put a :class:`Doorman` in front of their loop: it
answers handshake frames itself and lets a frame through only from an
identity that completed the handshake; anything else is counted and
answered in the socket's own protocol, once: a refused connection is then
ended. On the control and bootstrap sockets it also reports each
connection's progress to the socket's :class:`~pd_transfer.agent.lobby.Door`,
which bounds the connections that have not authenticated, and, with
identities checked, compares the names claimed with the connection's
identity key (:mod:`pd_transfer.agent.zap`). Connecting sockets (DEALER)
call :func:`authenticate` before their first frame.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import zmq
import zmq.asyncio

from pd_transfer.agent.lobby import Door, Lobby
from pd_transfer.agent.zap import ZapHandler
from pd_transfer.errors import AuthError, PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close, RankEntry, encode
from pd_transfer.security import (
    ClientHandshake,
    Decision,
    Gate,
    NonceBook,
    SecuritySettings,
    engine_trust,
    new_routing_id,
)
from pd_transfer.security.curve import Z85_ALPHABET, Z85_KEY_LEN
from pd_transfer.security.identity import IDENTITY_DOMAIN, Identity
from pd_transfer.wire.fields import clip_text

if TYPE_CHECKING:
    from pd_transfer.agent.zmq_bounds import PeerKeepalive
    from pd_transfer.config.sidecar import SidecarConfig

log = logging.getLogger(__name__)

#: after a refused handshake, how long a closed socket may still try to deliver the
#: refusal (closing with linger 0 would drop it, and the listener would not count it)
REFUSAL_LINGER_MS = 250


@dataclass
class Security:
    """One sidecar's security: settings, the nonce book its gates share, a failure counter."""

    settings: SecuritySettings = field(default_factory=SecuritySettings)
    agent_id: str = ""
    handshake_timeout_s: float = 10.0
    nonces: NonceBook = field(default_factory=NonceBook)
    on_failure: Callable[[str], None] = lambda reason: None  # reason code -> metrics
    lobby: Lobby = field(default_factory=Lobby)  # strangers on the listening sockets

    @classmethod
    def from_config(cls, config: SidecarConfig) -> Security:
        """ConfigError (exit code 2) for an unusable secret or key; see SecuritySettings."""
        lobby = Lobby(
            max_pending=config.max_pending_control_connections,
            max_total=config.max_pending_connections_total,
            timeout_s=config.control_handshake_timeout_s,
        )
        return cls(
            SecuritySettings.from_config(config), config.agent_id, config.bootstrap_timeout_s, lobby=lobby
        )

    @property
    def enabled(self) -> bool:
        return self.settings.auth_enabled

    def gate(self, *, identified: bool = False) -> Gate:
        """A listening socket's gate; ``identified``: it checks peers' identity keys."""
        identities = self.settings.identities if identified else None
        return Gate(self.settings.secret, self.agent_id, self.nonces, identities=identities)

    def log_mode(self, engine_listeners: list[str] | None = None) -> None:
        """The start log's security line; and a warning for an accepted engine transport whose
        own listeners (``engine_listeners``, as measured) authenticate nobody."""
        engine = self.settings.unauthenticated_engine
        if engine:
            log.warning(engine_trust.warning(engine, engine_listeners or []))
        if self.enabled:
            log.info("security: %s", self.settings.describe())
        else:
            log.warning(
                "security: INSECURE, %s (allow_insecure): any process that reaches this "
                "sidecar's ports may take or overwrite rooms' bytes; make a secret with "
                "`pd-transfer keygen --out DIR` and set secret_file",
                self.settings.describe(),
            )

    def failed(self, error: PdTransferError, where: str = "") -> None:
        """Count and log a failed handshake (``where``: the listening socket and peer)."""
        self.on_failure(error.code.value)
        log.warning(
            "%sauthentication failed [%s]: %s",
            f"{where}: " if where else "",
            error.code.value,
            error.message,
            extra={"reason": error.code.value},  # repeats are limited per reason
        )

    # -- sockets ------------------------------------------------------------------------
    def listening(
        self, socket: zmq.Socket[object], *, identified: bool = False, as_self: bool = False
    ) -> None:
        """CURVE server options for a socket about to bind (no-op without a key);
        ``identified``: its peers' identity keys are checked (control, bootstrap);
        ``as_self``: it serves with this sidecar's identity key where it has one (the
        control port: whoever connects then knows it reached this sidecar, see
        :attr:`control_key`)."""
        keypair = self.settings.curve_keypair
        if keypair is not None and as_self and self.settings.identity_keypair is not None:
            keypair = self.settings.identity_keypair
        if keypair is not None:
            socket.curve_secretkey = keypair.secret.encode()
            socket.curve_publickey = keypair.public.encode()
            socket.curve_server = True
        if identified and self.settings.identities is not None:
            socket.zap_domain = IDENTITY_DOMAIN.encode()  # agent/zap.py answers for it

    @property
    def control_key(self) -> str:
        """The public key this sidecar's control port serves with when it is its own identity
        key (announced in its rank entry); '' where it serves with the deployment's key."""
        identity = self.settings.identity_keypair
        return identity.public if identity is not None and self.settings.curve_keypair else ""

    def listener_key(self, entry: RankEntry) -> str:
        """The CURVE server key to expect of ``entry``'s control port ('' : the deployment's).

        With an allow-list (``identity_allow_file``), the rank must serve with the key listed
        for its agent id as a prefill: only the holder of that key's secret half completes
        the CURVE handshake, so a member posing as that prefill, or a listener at its address
        that is not it, is never talked to. AuthError ``identity_mismatch`` (counted) if the
        table names another key or none."""
        key = entry.control_key
        if self.settings.identities is None:
            return key if key and check_key_text(key) else ""
        who = self.settings.identities.get(key) if key else None
        if who is not None and who.role == Role.PREFILL.value and who.agent_id == entry.agent_id:
            return key
        listed = "another agent's key" if who is not None else "a key not in identity_allow_file"
        error = AuthError(
            f"prefill rank {entry.geometry.rank_id} of agent {entry.agent_id!r} at "
            f"{entry.control_address} serves its control port with "
            f"{listed if key else 'no identity key'}: not talking to it",
            code=Reason.IDENTITY_MISMATCH,
        )
        self.failed(error)
        raise error

    def curve_client(self, socket: zmq.Socket[object]) -> None:
        """CURVE client options only (data sockets: no HMAC handshake runs on them)."""
        if self.settings.curve_server_key:
            public, secret = zmq.curve_keypair()
            socket.curve_publickey, socket.curve_secretkey = public, secret
            socket.curve_serverkey = self.settings.curve_server_key.encode()

    def connecting(self, socket: zmq.Socket[object], server_key: str = "") -> None:
        """A random routing id (see :mod:`pd_transfer.security.gate`) and CURVE client
        options for a socket about to connect (no-op with both off); ``server_key``: the
        listener's own key (:meth:`listener_key`), else the deployment's is expected."""
        if self.enabled:
            socket.setsockopt(zmq.ROUTING_ID, new_routing_id())
        if self.settings.curve_server_key:
            identity = self.settings.identity_keypair
            if identity is not None:  # who this sidecar is (security/identity.py)
                public, secret = identity.public.encode(), identity.secret.encode()
            else:
                public, secret = zmq.curve_keypair()  # throwaway: CURVE does not say who connects
            socket.curve_publickey, socket.curve_secretkey = public, secret
            socket.curve_serverkey = (server_key or self.settings.curve_server_key).encode()


def check_key_text(key: str) -> bool:
    """Whether ``key`` (from the wire) is a Z85 CURVE key ZeroMQ would take."""
    return len(key) == Z85_KEY_LEN and set(key) <= Z85_ALPHABET


DISABLED = Security()


class SecureContext(zmq.asyncio.Context):
    """The sidecar's context: sockets made from it find the sidecar's :class:`Security`."""

    security: Security = DISABLED  # pyzmq contexts keep attributes declared on the class
    zap: ZapHandler | None = None  # checks identity keys (identity_allow_file)
    peer_keepalive: PeerKeepalive | None = None  # the kernel's, on control sockets (agent/zmq_bounds.py)

    def __init__(self, security: Security) -> None:
        super().__init__()
        self.security = security
        identities = security.settings.identities
        if identities is not None:  # bound before any socket that asks it
            self.zap = ZapHandler(self, identities, lambda reason: security.on_failure(reason))


def security_of(context: zmq.asyncio.Context) -> Security:
    return getattr(context, "security", DISABLED)


async def authenticate(
    socket: zmq.asyncio.Socket, security: Security, peer: str, timeout_s: float | None = None
) -> None:
    """Run the connecting side's handshake on ``socket`` (a DEALER).

    Raises AuthError when either side refuses (counted), PdTransferError
    ``timeout`` when no answer comes within ``timeout_s``.
    """
    timeout_s = security.handshake_timeout_s if timeout_s is None else timeout_s
    if security.settings.secret is None:
        raise ValueError("the handshake needs a shared secret")
    handshake = ClientHandshake(security.settings.secret, security.agent_id, peer=peer)
    deadline = time.monotonic() + timeout_s
    await socket.send(handshake.hello())
    while not handshake.done:
        remaining_ms = (deadline - time.monotonic()) * 1000
        if remaining_ms <= 0 or not await socket.poll(remaining_ms):
            raise PdTransferError(
                f"{peer}: no answer to the authentication handshake within {timeout_s:.1f} s",
                code=Reason.TIMEOUT,
            )
        try:
            reply = handshake.receive(await socket.recv())
        except AuthError as err:
            if err.reply is not None:
                await socket.send(err.reply)  # tell the listener why: it counts it too
            security.failed(err)  # its message names the peer
            raise
        if reply is not None:
            await socket.send(reply)


UnauthenticatedReply = Callable[[bytes, AuthError], bytes]


class Answering(Protocol):
    """The listening socket a doorman answers on: a ZeroMQ ROUTER, or a
    :class:`~pd_transfer.agent.stream_router.StreamRouter`."""

    def send_multipart(self, msg_parts: list[bytes], /) -> Awaitable[object]: ...


class Doorman:
    """Stands before one listening socket: ``await admit(identity, frame)`` says
    whether the frame may be handled; everything else it answers itself.

    ``unauthenticated_reply(frame, error)`` builds the answer to a frame sent
    before the handshake, in the socket's own protocol.
    """

    def __init__(
        self,
        socket: Answering,
        security: Security,
        where: str,
        unauthenticated_reply: UnauthenticatedReply,
        *,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        door: Door | None = None,
        identified: bool = False,
    ) -> None:
        self._socket = socket
        self._security = security
        self._gate = security.gate(identified=identified)  # identified: control, bootstrap
        self._where = where
        self._unauthenticated_reply = unauthenticated_reply
        self._on_bad_frame = on_bad_frame
        # the socket's strangers (agent/lobby.py), told apart by descriptor: None where the
        # owner cannot tell connections apart (then only the gate's own bounds apply)
        self.door = door if door is not None and door.active else None
        self._pending: dict[int, bytes] = {}  # a stranger's descriptor -> its routing id
        if self.door is not None:
            self.door.on_gone = self._gone

    def authenticated(self, identity: bytes) -> bool:
        """Whether ``identity`` may send frames past the gate (always, with authentication off)."""
        return not self._gate.enabled or bool(self._gate.peer_of(identity))

    def proven_agent_id(self, identity: bytes) -> str:
        """The agent id ``identity`` proved in its handshake ('' with authentication off)."""
        return self._gate.peer_of(identity)

    def proven_identity(self, identity: bytes) -> Identity | None:
        """The identity ``identity``'s key holds (None where names are not checked)."""
        return self._gate.identity_of(identity)

    async def admit(self, identity: bytes, frame: bytes, fd: int | None = None, user_id: str = "") -> bool:
        """Whether ``frame`` from ``identity`` (on descriptor ``fd``, where known; presenting
        the identity key ``user_id``, where checked) may be handled."""
        door = self.door
        if door is not None and fd is not None and not self._gate.knows(identity):
            if door.refused(fd) or door.stranger(fd) is None and fd not in door.members:
                if door.ended(fd):  # its connection ended before this frame was read
                    self._judge_late(identity, frame, user_id)
                return False  # refused: cut once its refusal left; or no room for it at all
            self._pending[fd] = identity
        admission = self._gate.admit(identity, frame, user_id)
        if admission.decision is Decision.PASS:
            self._admitted(fd)
            return True
        reply = admission.reply
        if admission.decision is Decision.ANSWER:
            if self._gate.knows(identity):
                self._admitted(fd)  # its proof was accepted
            elif door is not None:
                door.hello(fd)
        else:
            error = admission.error
            if error is None:  # the gate gives every refusal its error (security/gate.py)
                raise RuntimeError(f"{self._where}: a refusal without its error")
            self._security.failed(error, f"{self._where}: peer {identity.hex()[:12]}")
            if admission.decision is Decision.UNAUTHENTICATED:
                self._on_bad_frame(Reason.UNAUTHENTICATED.value)
                reply = self._unauthenticated_reply(frame, error)
            if door is not None:
                door.refuse(fd, REFUSAL_LINGER_MS / 1000)  # one answer, then the connection ends
        if reply is not None:
            try:
                await self._socket.send_multipart([identity, reply])
            except zmq.ZMQError as err:
                log.debug("%s: cannot answer peer %s: %s", self._where, identity.hex()[:12], err)
        return False

    def _judge_late(self, identity: bytes, frame: bytes, user_id: str) -> None:
        """A frame of a stranger whose connection has ended: judged and counted as if read in
        time (a garbage frame is a bad frame, a wrong proof an authentication failure), with
        no answer to send and no handshake state kept."""
        admission = self._gate.admit(identity, frame, user_id)
        self._gate.forget_pending(identity)
        if admission.error is not None:
            self._security.failed(admission.error, f"{self._where}: peer {identity.hex()[:12]} (gone)")
        if admission.decision is Decision.UNAUTHENTICATED:
            self._on_bad_frame(Reason.UNAUTHENTICATED.value)

    def revoke(self, identity: bytes, fd: int | None) -> None:
        """``identity`` proved the secret but broke the rules of the name it proved (it was
        sent a Close): it must authenticate again, and its connection ends."""
        self._gate.forget(identity)
        if self.door is not None:
            self.door.refuse(fd, REFUSAL_LINGER_MS / 1000)

    def _admitted(self, fd: int | None) -> None:
        if fd is not None:
            self._pending.pop(fd, None)
        if self.door is not None:
            self.door.admitted(fd)

    def _gone(self, fd: int) -> None:
        identity = self._pending.pop(fd, None)
        if identity is not None:
            self._gate.forget_pending(identity)


def source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection ``frame`` came on (None where ZeroMQ cannot say)."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None


def peer_key(frame: zmq.Frame) -> str:
    """The identity key ZeroMQ's ZAP handler bound to ``frame``'s connection ('' if none)."""
    try:
        key = frame.get("User-Id")  # a string property: ZeroMQ gives it as str
        return key if isinstance(key, str) else ""
    except zmq.ZMQError:
        return ""


def close_reply(frame: bytes, error: AuthError) -> bytes:
    """The answer of a control or bootstrap socket to a frame sent before the handshake."""
    return encode(Close(reason=error.code, reason_text=clip_text(str(error))))
