"""Who may talk to a sidecar: shared-secret authentication and CURVE keys, sans-IO.

Every connection to a sidecar (a decode's control session with a prefill
rank, a rank-table request to the bootstrap, a worker's calls) first proves
knowledge of a shared secret with a mutual HMAC-SHA256 handshake; frames of a
connection that has not are dropped, counted and answered with a reason.
Optionally ZeroMQ CURVE encrypts the tcp sockets as well.

    secret.py      the shared secret: file or variable, hex or raw, >= 16 bytes,
                   never printed
    messages.py    AuthHello, AuthChallenge, AuthProof, AuthResult; strict codec
    handshake.py   proofs, ClientHandshake, ServerHandshake, NonceBook (replays)
    gate.py        the listening side's per-identity state: pass, answer, refuse
    curve.py       CURVE key files and ``pd-transfer keygen``
    identity.py    per-sidecar identity keys, their allow-list, ``pd-transfer identity``
    settings.py    SecuritySettings.from_config: everything resolved at startup
    engine_trust.py  engine transports whose own listeners authenticate nobody:
                   started only when the operator accepts that by name

The agent drives these over its sockets (:mod:`pd_transfer.agent.auth`), the
client library over its own (:mod:`pd_transfer.client.auth`).

May import the standard library, ``pd_transfer.errors``, ``pd_transfer.wire``
and ``pd_transfer.protocol``. Never asyncio, sockets, the transport or the agent
(:mod:`curve` imports zmq inside functions for libzmq's key functions only).
"""

from pd_transfer.errors import AuthError
from pd_transfer.security.gate import Decision, Gate, GateAnswer, new_routing_id
from pd_transfer.security.handshake import ClientHandshake, NonceBook, ServerHandshake
from pd_transfer.security.secret import SharedSecret, load_secret, parse_secret
from pd_transfer.security.settings import SecuritySettings

__all__ = [
    "GateAnswer",
    "AuthError",
    "ClientHandshake",
    "Decision",
    "Gate",
    "NonceBook",
    "SecuritySettings",
    "ServerHandshake",
    "SharedSecret",
    "load_secret",
    "new_routing_id",
    "parse_secret",
]
