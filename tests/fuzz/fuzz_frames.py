"""Seed frames, mutations and live targets for fuzzing a running sidecar.

Shared by ``tests/fuzz`` (hypothesis draws the mutation parameters) and
``benchmarks/fuzz_sidecar.py`` (a seeded mutation loop for N seconds).

A prefill sidecar listens on three sockets that take frames from elsewhere:

- the control ROUTER (decode peers, :mod:`pd_transfer.protocol` frames),
- the worker endpoint (the local worker, :mod:`pd_transfer.protocol.worker_api`),
- the bootstrap ROUTER on rank 0 (rank-table frames).

Each :class:`Target` is a raw DEALER on one of them that classifies every
frame it sends the way the sidecar must treat it (valid, or bad and to be
counted) and counts the replies.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import zmq

from pd_transfer.client.links import StreamLink
from pd_transfer.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.protocol import Announce, Dropped, Hello, Session, TableRequest, decode, encode
from pd_transfer.protocol.worker_api import WorkerApiError, WorkerOp, decode_request
from pd_transfer.protocol.worker_api import encode as encode_request

BYTE_OPS = ("flip", "delete", "insert", "truncate", "duplicate")
FRAMES_SENT: Counter = Counter()  # socket -> frames sent by the tests (terminal summary)
FRAMES_SKIPPED: Counter = Counter()  # what the tests drew but did not send, and why


# -- seeds ------------------------------------------------------------------------------


def control_seeds(messages) -> list[bytes]:
    """Frames a decode peer may send (and some it may not: every message type)."""
    return [encode(m) for m in messages]


def bootstrap_seeds(entry) -> list[bytes]:
    return [encode(TableRequest(agent_id="fuzz-0")), encode(Announce(entry=entry))]


def worker_seeds(geometry: RankGeometry, handles: dict[str, str]) -> list[bytes]:
    """One request of every worker op, with small values (``wait`` for 10 ms)."""
    from pd_transfer.client import calls as wire

    requests = [
        wire.register_request(geometry, handles, "fuzz-worker"),
        wire.send_request(70, [0, 1, 2], state_slots=[], aux_row=1, last_chunk=False),
        wire.send_request(71, [3], last_chunk=True),
        wire.expect_request(72, "tcp://127.0.0.1:1", [0, 1]),
        wire.layer_ready_request(70, 1),
        wire.poll_request(70),
        wire.wait_request(71, 0.01),
        wire.abort_request(73),
    ]
    return [encode_request({**r, "id": i + 1}) for i, r in enumerate(requests)]


# -- mutations ----------------------------------------------------------------------------


def byte_mutation(frame: bytes, edits) -> bytes:
    """Apply ``edits`` [(op, where, value)] to the raw bytes."""
    data = bytearray(frame)
    for op, where, value in edits:
        at = where % max(len(data), 1)
        if op == "flip" and data:
            data[at] ^= value or 1
        elif op == "delete" and data:
            del data[at : at + 1 + value % 8]
        elif op == "insert":
            data[at:at] = bytes([value]) * (1 + value % 4)
        elif op == "duplicate" and data:
            data[at:at] = data[at : at + 1 + value]
        else:
            del data[at:]
    return bytes(data)


def _nodes(value, path=()):
    yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _nodes(child, path + (key,))


def field_mutation(frame: bytes, which: int, new_value) -> bytes:
    """Replace one node (picked by ``which``) of the decoded frame with ``new_value``."""
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:  # not msgpack: mutate bytes instead
        return byte_mutation(frame, [("flip", which, 0x5A)])
    nodes = list(_nodes(raw))
    path, _ = nodes[which % len(nodes)]
    if not path:
        raw = new_value
    else:
        parent = raw
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = new_value
    try:
        return msgpack.packb(raw, use_bin_type=True)
    except Exception:  # e.g. an int too large for msgpack
        return frame[: which % max(len(frame), 1)]


_ODD_VALUES = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x" * 300,
    b"\x00" * 16,
    [],
    {},
    [[[[[]]]]],
    {"op": "send"},
]


def random_value(rng: random.Random):
    choice = rng.random()
    if choice < 0.5:
        return rng.choice(_ODD_VALUES)
    if choice < 0.7:
        return rng.randrange(-(2**63), 2**64)
    if choice < 0.85:
        return "".join(rng.choice("abc/.:-_0") for _ in range(rng.randrange(12)))
    return [rng.randrange(256) for _ in range(rng.randrange(6))]


def random_mutation(rng: random.Random, seeds: list[bytes]) -> bytes:
    """One mutated frame (for the benchmark loop)."""
    kind = rng.random()
    if kind < 0.1:
        return rng.randbytes(rng.randrange(64))
    frame = rng.choice(seeds)
    if kind < 0.55:
        edits = [
            (rng.choice(BYTE_OPS), rng.randrange(1 << 20), rng.randrange(256))
            for _ in range(rng.randint(1, 4))
        ]
        return byte_mutation(frame, edits)
    return field_mutation(frame, rng.randrange(1 << 20), random_value(rng))


# -- classification -------------------------------------------------------------------------


def control_is_valid(frame: bytes) -> bool:
    """True if the codec accepts the frame (the session may still refuse it in its state)."""
    try:
        decode(frame)
    except ProtocolError:
        return False
    return True


HELLO = encode(Hello(agent_id="fuzz-decode", role=Role.DECODE))


def control_outcome(frame: bytes, after_hello: bool) -> str:
    """What a fresh prefill session does with ``frame``.

    'counted': a bad frame the sidecar must count and answer: a
    RemoteProtocolError, or a frame the codec accepts that is no session
    message at all (a bootstrap frame), which the session refuses with a
    LocalProtocolError; 'dropped' or 'accepted'.
    Mirrors the sidecar's session for one frame on a new connection
    (optionally after a Hello, which the sidecar answers before reading on).
    """
    session = Session(Role.PREFILL)
    if after_hello:
        session.receive_data(HELLO)
        session.send(Hello(agent_id="prefill", role=Role.PREFILL))
    try:
        event = session.receive_data(frame)
    except RemoteProtocolError:
        return "counted"
    except LocalProtocolError:
        return "counted"
    return "dropped" if isinstance(event, Dropped) else "accepted"


def bootstrap_kind(frame: bytes) -> str:
    """'table_request' (must be answered), 'announce' (valid: replaces a rank), 'bad'."""
    try:
        message = decode(frame)
    except ProtocolError:
        return "bad"
    if isinstance(message, TableRequest):
        return "table_request"
    return "announce" if isinstance(message, Announce) else "bad"


def worker_kind(frame: bytes) -> str:
    """'bad' (to be refused and counted), 'slow_wait' (answered later) or 'valid'."""
    try:
        op, request = decode_request(frame)
    except WorkerApiError:
        return "bad"
    if op is WorkerOp.WAIT and not request["timeout_s"] <= 0.5:
        return "slow_wait"  # answered when its own timeout passes (or never, for inf/nan)
    return "valid"


# -- live targets ------------------------------------------------------------------------------


@dataclass
class Target:
    """A raw DEALER on one sidecar socket (or, for a ``unix://`` worker endpoint, a
    raw Unix stream with length headers); counts frames by kind and replies."""

    name: str
    address: str
    kinds: Counter = field(default_factory=Counter)
    replies: list = field(default_factory=list)
    socket: zmq.Socket | None = None
    stream: StreamLink | None = None

    def __post_init__(self) -> None:
        if self.address.startswith("unix://"):
            self.stream = StreamLink(self.address.removeprefix("unix://"))
            return
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.connect(self.address)

    @property
    def sent(self) -> int:
        return sum(self.kinds.values())

    def send(self, frame: bytes, kind: str, parts: tuple[bytes, ...] = ()) -> None:
        self.kinds[kind] += 1
        if self.stream is not None:
            if parts:
                raise ValueError("a unix:// stream carries no multipart frames")
            self.stream.send(frame, time.monotonic() + 10)
        else:
            self.socket.send_multipart([frame, *parts])
        self.drain(0)

    def drain(self, timeout_s: float) -> int:
        """Collect replies for up to ``timeout_s`` (0: only those already here)."""
        deadline = time.monotonic() + timeout_s
        if self.stream is not None:
            while (reply := self.stream.receive(deadline)) is not None:
                self.replies.append(reply)
            return len(self.replies)
        while self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            self.replies.append(self.socket.recv_multipart()[-1])
        return len(self.replies)

    def drain_until(self, count: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while len(self.replies) < count and time.monotonic() < deadline:
            self.drain(0.05)
        return len(self.replies)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        else:
            self.socket.close(linger=0)


class FreshSessions:
    """Each frame on a new DEALER (a new identity: a new session on the sidecar's ROUTER).

    A fresh session makes the sidecar's reaction to a frame predictable
    (:func:`control_outcome`), so the test can demand that exactly the frames
    its session refuses are counted.
    """

    def __init__(self, name: str, address: str) -> None:
        self.name, self.address = name, address
        self.kinds: Counter = Counter()
        self.replies: list = []
        self._context = zmq.Context.instance()
        # each frame's socket lingers until its frames left: allow many at once
        self._context.set(zmq.MAX_SOCKETS, max(self._context.get(zmq.MAX_SOCKETS), 16384))

    @property
    def sent(self) -> int:
        return sum(self.kinds.values())

    def send(self, frame: bytes, after_hello: bool) -> str:
        outcome = control_outcome(frame, after_hello)
        self.kinds[outcome] += 1
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)  # let the frames leave after close()
        socket.connect(self.address)
        if after_hello:
            socket.send(HELLO)
        socket.send(frame)
        socket.close()
        return outcome

    def close(self) -> None:
        pass
