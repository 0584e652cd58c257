"""The wire messages between a prefill sidecar and a decode sidecar.

Every message is a frozen dataclass with a type tag (``TAG``). On the wire a
message is a msgpack map ``{"t": tag, "v": [major, minor], <fields by name>}``
(see :mod:`codec`); nothing is positional. Evolution rules, as in msgspec:
a MINOR version may add message fields (always with a default) and reason
codes; a peer ignores fields it does not know. Anything else (removing or
retyping a field, a new required field, a new message type that a peer must
understand) is a MAJOR version, and peers of different majors refuse each
other at the first frame.

Version history:
    1.0  first version.

Identifiers:
    room        an int in [0, 2**64), assigned by the router (like SGLang's
                bootstrap room); unique per request, shared by both sides.
    generation  an int in [0, 2**64): which attempt of a room a message is
                about. Decode raises it to re-request a room after an abort;
                messages of an older generation are stale and dropped.

Pure data; imports the layout layer's value types, nothing with I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from pd_transfer.errors import Mismatch, Reason
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.reconcile import Mode
from pd_transfer.layout.views import Pool

PROTOCOL_VERSION: tuple[int, int] = (1, 0)


class Message:
    """Base of all wire messages. ``TAG`` is the ``"t"`` value on the wire."""

    TAG: ClassVar[str] = ""


class RoomMessage(Message):
    """Base of the messages about one generation of a room (:data:`ROOM_MESSAGES`); the
    session checks each against the room's current generation."""

    room: int
    generation: int


#: the Hello feature of agents that speak the decode -> prefill confirming Done
CONFIRM_DONE = "confirm_done"
#: the Hello feature of prefill agents that act on :class:`RoomRefused`
ROOM_REFUSAL = "room_refusal"
#: the Hello feature of prefill agents that also act on :class:`RoomRefused` from an accepted
#: decode rank: a room decode gave up before claiming it (its request ended, or was unloadable)
ROOM_ABANDON = "room_abandon"
#: the room features every agent of this version offers in its Hello
ROOM_FEATURES = (CONFIRM_DONE, ROOM_REFUSAL, ROOM_ABANDON)


class DoneStatus(enum.Enum):
    SUCCESS = "success"
    FAILED = "failed"


# -- connection ---------------------------------------------------------------


@dataclass(frozen=True)
class Capabilities:
    """What an agent can do. Open sets: a peer ignores names it does not know.

    ``transports`` names data planes (``shm``, ``tcp``, ``mock``, ``mooncake``);
    ``features`` names optional behaviours (``per_layer_send``, ...).
    ``confirm_done`` (:data:`CONFIRM_DONE`): this agent understands, and on
    decode sends, the decode -> prefill Done that confirms a room's bytes.
    """

    transports: tuple[str, ...] = ()
    features: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """First frame each way: who I am and what I speak."""

    TAG: ClassVar[str] = "hello"
    agent_id: str
    role: Role
    protocol_version: tuple[int, int] = PROTOCOL_VERSION
    capabilities: Capabilities = Capabilities()


@dataclass(frozen=True)
class RegionHandle:
    """How a peer on the same host maps a region: a shared-memory segment name,
    later a CUDA IPC handle."""

    region: str
    handle: str


@dataclass(frozen=True, kw_only=True)
class Register(Message):
    """This rank's full geometry: regions, tensor views, TP/PP position, page size.

    ``data_address`` is where a tcp data plane reaches this rank (decode),
    or, for the mooncake and nixl transports, the engine's address with the
    addresses of the registered regions (``transport/engines/address.py``);
    ``region_handles`` let a writer on the same host (``host_id``) map the
    regions directly. Both optional (added in 1.0, before any release).
    ``doorbell`` (decode, optional, same release): the shared-memory segment
    of its doorbells (:mod:`pd_transfer.memory.doorbell`), which a writer on the same
    host rings when a room's bytes have landed. ``instance`` (decode, optional,
    same release): the name of the decode instance this rank belongs to; a
    prefill worker's ``send(..., decode=NAME)`` binds a room to it.
    ``pp_size`` (decode, optional, same release): its instance's pipeline
    stages; prefill answers once all ``attn_tp_size * pp_size`` ranks of the
    instance registered (:mod:`pd_transfer.agent.prefill.decode_instances`).
    ``pid`` and ``process_start_ticks`` (optional, same release; 0: not told):
    the sender's process, which a peer on the same host watches directly
    (``agent/peer_process.py``).
    """

    TAG: ClassVar[str] = "register"
    agent_id: str
    host_id: str
    geometry: RankGeometry
    data_address: str = ""
    region_handles: tuple[RegionHandle, ...] = ()
    doorbell: str = ""
    instance: str = ""  # decode: the instance this rank belongs to (its rooms' owner name)
    pp_size: int = 1  # decode: its instance's pipeline stages
    pid: int = 0  # the sender's process id
    process_start_ticks: int = 0  # its start time (/proc/PID/stat field 22)


@dataclass(frozen=True)
class PoolPlan:
    """How one pool's tensors of one mode move between this rank pair.

    ``descriptors_per_item`` and ``nbytes_per_item`` count copy descriptors and
    bytes for one index item (a page, slot or row) of the pool. ``strategy``
    says how prefill moves the pool to this rank: ``direct`` (one descriptor
    per run), ``staged`` (gathered into bulk transfers, scattered on arrival),
    or empty where not reported (added in 1.0, before any release; a value
    this version does not know is kept as text).
    """

    pool: Pool
    mode: Mode
    num_tensors: int
    descriptors_per_item: int
    nbytes_per_item: int
    strategy: str = ""


@dataclass(frozen=True)
class MismatchRecord:
    """One reconciliation mismatch as it travels: both sides' values as text."""

    path: str
    code: Reason
    prefill: str
    decode: str
    hint: str = ""

    @staticmethod
    def from_mismatch(mismatch: Mismatch) -> MismatchRecord:
        shown = mismatch.to_dict()
        return MismatchRecord(
            path=mismatch.path,
            code=mismatch.code,
            prefill=shown["prefill"],
            decode=shown["decode"],
            hint=mismatch.hint,
        )

    def render(self) -> str:
        return f"{self.path}: prefill={self.prefill} decode={self.decode}  [{self.code.value}]"


@dataclass(frozen=True, kw_only=True)
class Verdict(Message):
    """Prefill's answer to a registration, before any traffic.

    Accepted: ``plan`` summarises every (pool, mode), ``mismatches`` is empty.
    Rejected: ``mismatches`` lists every difference, ``headline`` says which
    sides (``cannot reconcile prefill (attn_tp=2) with decode (attn_tp=4)``).
    """

    TAG: ClassVar[str] = "verdict"
    accepted: bool
    plan: tuple[PoolPlan, ...] = ()
    headline: str = ""
    mismatches: tuple[MismatchRecord, ...] = ()
    # True: both sides enabled integrity, every successful Done carries checksums
    # (added in 1.0, before any release)
    integrity: bool = False
    # True: prefill mapped decode's doorbells and rings them (same host, shm; same release)
    doorbell: bool = False
    transport: str = ""  # what prefill writes with ("shm", "tcp", ...), for decode's /status


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """Liveness, both ways; ``sent_unix_s`` lets the receiver see clock skew and delay.
    ``stalled_s`` (optional, same release as 1.0): the longest stall of the sender's
    event loop over the recent past, which the receiver allows for in its silences."""

    TAG: ClassVar[str] = "heartbeat"
    agent_id: str
    sequence: int
    sent_unix_s: float
    stalled_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Close(Message):
    """The sender will send nothing more on this session. ``reason`` None is a
    normal shutdown; otherwise it says what went wrong (a protocol error)."""

    TAG: ClassVar[str] = "close"
    reason: Reason | None = None
    reason_text: str = ""


# -- rooms --------------------------------------------------------------------


@dataclass(frozen=True)
class PoolIndices:
    """Destination indices in one pool: pages (kv, swa), state slots (mamba), rows (aux)."""

    pool: Pool
    indices: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class TransferRequest(RoomMessage):
    """Decode -> prefill: write room ``room`` into these destination indices.

    ``src_ranks`` lists every prefill rank id (``prefill[pp0,tp1]``) decode
    expects a Done from for this room, so a prefill rank knows its peers.
    ``doorbell`` ``(slot, token, writer)``: ring that doorbell as writer
    number ``writer`` once every byte of the room has landed, before Done
    (optional; only to a rank whose Verdict said it rings).
    ``held_pages`` (optional, same release): the first ``held_pages`` kv
    pages of ``dst`` already hold the room's tokens (decode's prefix cache);
    prefill writes nothing into them.
    """

    TAG: ClassVar[str] = "transfer_request"
    room: int
    generation: int
    dst: tuple[PoolIndices, ...]
    src_ranks: tuple[str, ...] = ()
    doorbell: tuple[int, int, int] | None = None
    held_pages: int = 0


@dataclass(frozen=True, kw_only=True)
class Progress(RoomMessage):
    """Prefill -> decode: bytes of this room written so far."""

    TAG: ClassVar[str] = "progress"
    room: int
    generation: int
    done_nbytes: int
    total_nbytes: int


@dataclass(frozen=True)
class PoolChecksums:
    """CRC32 summary of what one prefill rank wrote into one pool of a room.

    ``items[k]`` covers every block of the k-th destination index (page, slot,
    row), ``tensors[u]`` every block of unit ``u`` (a tensor and shard piece);
    see :mod:`pd_transfer.transport.copy.checksums`.
    """

    pool: Pool
    items: tuple[int, ...]
    tensors: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Done(RoomMessage):
    """Prefill -> decode: the room finished. A failure always carries a reason.

    ``checksums`` (success only, when the Verdict said ``integrity``) lets
    decode verify what landed; added in 1.0, before any release.

    Decode -> prefill (only a success, only between agents that both offer
    :data:`CONFIRM_DONE`): decode has the room's bytes (landed, and verified
    when the pair checks integrity). Prefill's room succeeds on it.
    """

    TAG: ClassVar[str] = "done"
    room: int
    generation: int
    status: DoneStatus
    reason: Reason | None = None
    reason_text: str = ""
    checksums: tuple[PoolChecksums, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Abort(RoomMessage):
    """Either side: stop this generation of the room. The other side answers
    with :class:`AbortAck` once no write of the generation can still land."""

    TAG: ClassVar[str] = "abort"
    room: int
    generation: int
    reason: Reason
    reason_text: str


@dataclass(frozen=True, kw_only=True)
class RoomRefused(Message):
    """Decode -> prefill (offering :data:`ROOM_REFUSAL`), on a rejected session: ``room`` was
    to be this decode rank's; it fails with ``reason_text``, not at a bootstrap timeout.
    On an accepted session (to a prefill offering :data:`ROOM_ABANDON`): decode will never
    claim ``room`` (its request ended first, or cannot load); it fails the same way."""

    TAG: ClassVar[str] = "room_refused"
    room: int
    reason: Reason
    reason_text: str


@dataclass(frozen=True, kw_only=True)
class AbortAck(RoomMessage):
    """Answer to :class:`Abort`. ``drained`` True: no write of this generation is
    in flight, decode may reuse the destination pages. False: some write may
    still land (a transfer engine could not be cancelled); keep them fenced."""

    TAG: ClassVar[str] = "abort_ack"
    room: int
    generation: int
    drained: bool


@dataclass(frozen=True)
class MessageType:
    cls: type[Message]
    description: str


MESSAGE_TYPES: dict[str, MessageType] = {
    t.cls.TAG: t
    for t in (
        MessageType(Hello, "first frame each way: agent id, role, protocol version, capabilities"),
        MessageType(Register, "this rank's full geometry (regions, tensor views, TP/PP, page size)"),
        MessageType(Verdict, "prefill's explicit accept (with plan summary) or reject (every mismatch)"),
        MessageType(TransferRequest, "decode asks for a room: destination indices per pool, generation"),
        MessageType(Progress, "prefill reports bytes written for a room"),
        MessageType(
            Done,
            "prefill reports a room finished: success, or failed with a reason; "
            "decode confirms a success: it has the bytes",
        ),
        MessageType(Abort, "either side stops a room's generation, with a reason"),
        MessageType(AbortAck, "answer to Abort: whether no write of that generation can still land"),
        MessageType(RoomRefused, "a rejected decode rank's room fails on prefill too, with its reason"),
        MessageType(Heartbeat, "liveness, both ways, in every live session state"),
        MessageType(Close, "the sender will send nothing more; a reason if it is an error"),
    )
}

ROOM_MESSAGES: tuple[type[RoomMessage], ...] = (TransferRequest, Progress, Done, Abort, AbortAck)
