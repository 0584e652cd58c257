"""Fuzz: random bytes and mutated valid frames never crash the decoder.

The only exception decode() may raise is ProtocolError; a session fed the
same frames either delivers, drops, or raises RemoteProtocolError. The number
of frames tried is printed in the terminal summary ("protocol fuzz: ...").
"""

import random

import msgpack
from fuzz_counter import FRAMES_TRIED
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_samples import every_message, transfer_request
from session_pair import SessionPair

from pd_transfer.errors import ProtocolError, RemoteProtocolError
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Dropped, Message, SessionState, decode, encode

FRAMES = [encode(m) for m in every_message()]
SMALL_FRAMES = [f for f in FRAMES if len(f) < 1024]
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def _decode_or_protocol_error(frame: bytes, kind: str) -> None:
    FRAMES_TRIED[kind] += 1
    try:
        message = decode(frame)
    except ProtocolError as exc:
        assert exc.code is not None and str(exc)
    else:
        assert isinstance(message, Message)


@settings(FUZZ, max_examples=1500)
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_protocol_error(frame):
    _decode_or_protocol_error(frame, "random bytes")


@settings(FUZZ, max_examples=1500)
@given(
    st.sampled_from(FRAMES),
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "delete", "insert", "truncate"]),
            st.integers(0, 1 << 20),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_byte_mutated_frames_raise_only_protocol_error(frame, edits):
    data = bytearray(frame)
    for op, where, value in edits:
        at = where % max(len(data), 1)
        if op == "flip" and data:
            data[at] ^= value or 1
        elif op == "delete" and data:
            del data[at]
        elif op == "insert":
            data.insert(at, value)
        else:
            del data[at:]
    _decode_or_protocol_error(bytes(data), "byte mutations")


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=24),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def _nodes(value, path=()):
    """Every (path, value) inside a decoded frame, the frame itself first."""
    yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _nodes(child, path + (key,))


def _replace(value, path, new):
    if not path:
        return new
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return value


@settings(FUZZ, max_examples=800)
@given(st.sampled_from(FRAMES), st.integers(0, 1 << 20), msgpack_values)
def test_field_mutated_frames_raise_only_protocol_error(frame, which, new_value):
    raw = msgpack.unpackb(frame)
    nodes = list(_nodes(raw))
    path, _ = nodes[which % len(nodes)]
    mutated = _replace(raw, path, new_value)
    _decode_or_protocol_error(msgpack.packb(mutated, use_bin_type=True), "field mutations")


def test_seeded_mutation_sweep_raises_only_protocol_error():
    rng = random.Random(20240601)
    for _ in range(20000):
        data = bytearray(rng.choice(SMALL_FRAMES))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data)) if data else 0
            choice = rng.random()
            if choice < 0.6 and data:
                data[at] = rng.randrange(256)
            elif choice < 0.8:
                data.insert(at, rng.randrange(256))
            elif data:
                del data[at]
        _decode_or_protocol_error(bytes(data), "seeded sweep")


@settings(FUZZ, max_examples=100)
@given(st.sampled_from(SMALL_FRAMES), st.integers(0, 1 << 20), st.integers(0, 255))
def test_session_fed_mutated_frames_delivers_drops_or_raises_remote_error(frame, where, value):
    pair = SessionPair().drive_to(SessionState.ACCEPTED)
    pair.deliver(Role.DECODE, transfer_request())
    data = bytearray(frame)
    data[where % len(data)] ^= value or 1
    FRAMES_TRIED["session"] += 1
    try:
        result = pair[Role.DECODE].receive_data(bytes(data))
    except RemoteProtocolError as exc:
        assert exc.reply is not None
    else:
        assert isinstance(result, (Message, Dropped))
