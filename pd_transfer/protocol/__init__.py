"""The wire protocol between prefill and decode sidecars, sans-IO.

Bytes in, typed messages out, and a state machine that says which message is
legal when. No sockets, no asyncio, no zmq, no clocks: the agent reads a
frame from its socket, hands it to :meth:`Session.receive_data`, acts on the
message it gets back, and writes the frames :meth:`Session.send` returns.

    messages.py        the frozen, tagged message dataclasses; PROTOCOL_VERSION;
                       MESSAGE_TYPES (tag -> class, one-line description)
    geometry_codec.py  RankGeometry <-> plain data, strictly checked
    schema.py          every message's fields and cross-field invariants
    codec.py           encode(message) -> bytes, decode(bytes) -> message
    transitions.py     session states, triggers, TRANSITIONS (the table)
    generations.py     room generations: fresh, stale, unknown, duplicate, future
    room_status.py     a room's monotonic status; Failed sticky, Success final
    session.py         Session: applies the tables to what is sent and received
    worker_api.py      the worker <-> sidecar requests (a separate, local contract)

Field kinds, the envelope and every size cap come from :mod:`pd_transfer.wire`.

May import: the standard library, ``pd_transfer.errors``,
``pd_transfer.wire`` and ``pd_transfer.layout``. Never the transport or agent layers.
"""

from pd_transfer.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from pd_transfer.protocol.codec import decode, encode
from pd_transfer.protocol.generations import FRESHNESS_RULES, Freshness
from pd_transfer.protocol.geometry_codec import geometry_from_data, geometry_to_data
from pd_transfer.protocol.messages import (
    CONFIRM_DONE,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROOM_ABANDON,
    ROOM_FEATURES,
    ROOM_REFUSAL,
    Abort,
    AbortAck,
    Capabilities,
    Close,
    Done,
    DoneStatus,
    Heartbeat,
    Hello,
    Message,
    MismatchRecord,
    PoolChecksums,
    PoolIndices,
    PoolPlan,
    Progress,
    RegionHandle,
    Register,
    RoomMessage,
    RoomRefused,
    TransferRequest,
    Verdict,
)
from pd_transfer.protocol.rank_table import (
    BOOTSTRAP_MESSAGE_TYPES,
    Announce,
    RankEntry,
    RankTable,
    TableRequest,
)
from pd_transfer.protocol.room_status import ROOM_TRANSITIONS, RoomGeneration, RoomStatus
from pd_transfer.protocol.session import Dropped, Session
from pd_transfer.protocol.transitions import TRANSITIONS, SessionState, Trigger, allowed, trigger_of
from pd_transfer.wire.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "DEFAULT_LIMITS",
    "FRESHNESS_RULES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "ROOM_TRANSITIONS",
    "TRANSITIONS",
    "Abort",
    "AbortAck",
    "Capabilities",
    "Close",
    "Done",
    "DoneStatus",
    "Dropped",
    "Freshness",
    "Heartbeat",
    "Hello",
    "Limits",
    "LocalProtocolError",
    "Message",
    "MismatchRecord",
    "PoolChecksums",
    "PoolIndices",
    "PoolPlan",
    "Progress",
    "ProtocolError",
    "Register",
    "RemoteProtocolError",
    "RoomGeneration",
    "RoomStatus",
    "Session",
    "SessionState",
    "TransferRequest",
    "Trigger",
    "Verdict",
    "allowed",
    "decode",
    "encode",
    "geometry_from_data",
    "geometry_to_data",
    "trigger_of",
    "BOOTSTRAP_MESSAGE_TYPES",
    "CONFIRM_DONE",
    "ROOM_ABANDON",
    "ROOM_FEATURES",
    "ROOM_REFUSAL",
    "RoomMessage",
    "RoomRefused",
    "Announce",
    "RankEntry",
    "RankTable",
    "RegionHandle",
    "TableRequest",
]
