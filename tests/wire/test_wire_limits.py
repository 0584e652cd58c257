"""The one limits table: every cap holds at exactly its value, one over is refused by path."""

import ast
from pathlib import Path

import msgpack
import pytest

from pd_transfer.errors import ProtocolError, Reason, TransportError
from pd_transfer.protocol import Close, decode, encode
from pd_transfer.security import messages as handshake
from pd_transfer.transport.engines.staging import channel_requests as staging
from pd_transfer.transport.tcp import frames
from pd_transfer.wire.envelope import unpack
from pd_transfer.wire.limits import (
    DATA_PLANE_HEADER_NBYTES,
    FAIL_TEXT_SENT_LEN,
    FRAMINGS,
    MAX_FAIL_TEXT_LEN,
    MAX_HANDSHAKE_TEXT_LEN,
    MAX_ID_LEN,
    MAX_REGIONS_PER_CHUNK,
    MAX_RING_SLOTS,
    MAX_TEXT_LEN,
    Limits,
)

PACKAGE = Path(__file__).resolve().parents[2] / "pd_transfer"


def _frame_of(nbytes: int) -> bytes:
    """A msgpack bin that is exactly ``nbytes`` long (its header is 2, 3 or 5 bytes)."""
    for header in (5, 3, 2):
        frame = msgpack.packb(bytes(nbytes - header), use_bin_type=True)
        if len(frame) == nbytes:
            return frame
    raise AssertionError(nbytes)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _unpack_error(frame: bytes, limits: Limits) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        unpack(frame, limits)
    assert caught.value.path == "$"
    return caught.value


@pytest.mark.parametrize("name", sorted(FRAMINGS))
def test_each_framing_s_unpacking_caps_hold_at_exactly_their_value(name):
    limits = FRAMINGS[name]
    assert len(unpack(_frame_of(limits.max_frame_nbytes), limits)) > 0
    assert _unpack_error(_frame_of(limits.max_frame_nbytes + 1), limits).code is Reason.FRAME_TOO_LARGE
    cases = [
        ("x" * limits.max_str_len, "x" * (limits.max_str_len + 1)),
        ([0] * limits.max_list_len, [0] * (limits.max_list_len + 1)),
        ({str(i): 0 for i in range(limits.max_map_len)}, {str(i): 0 for i in range(limits.max_map_len + 1)}),
    ]
    for at_limit, over in cases:
        if len(msgpack.packb(over)) > limits.max_frame_nbytes:
            continue  # the frame cap refuses it first (checked above)
        assert unpack(msgpack.packb(at_limit), limits) == at_limit
        assert _unpack_error(msgpack.packb(over), limits).code is Reason.LIMIT_EXCEEDED
    assert unpack(msgpack.packb(_nested(limits.max_depth)), limits) == _nested(limits.max_depth)
    assert _unpack_error(msgpack.packb(_nested(limits.max_depth + 1)), limits).code is Reason.LIMIT_EXCEEDED


def test_protocol_reason_text_cap():
    assert decode(encode(Close(reason_text="x" * MAX_TEXT_LEN))).reason_text == "x" * MAX_TEXT_LEN
    raw = msgpack.unpackb(encode(Close()))
    raw["reason_text"] = "x" * (MAX_TEXT_LEN + 1)
    with pytest.raises(ProtocolError) as caught:
        decode(msgpack.packb(raw))
    assert caught.value.path == "$.close.reason_text"


def test_handshake_text_and_id_caps():
    result = handshake.AuthResult(accepted=False, reason=Reason.AUTH_FAILED, reason_text="x" * 5000)
    assert len(handshake.decode(handshake.encode(result)).reason_text) <= MAX_HANDSHAKE_TEXT_LEN
    exact = handshake.AuthResult(
        accepted=False, reason=Reason.AUTH_FAILED, reason_text="x" * MAX_HANDSHAKE_TEXT_LEN
    )
    assert handshake.decode(handshake.encode(exact)) == exact
    raw = msgpack.unpackb(handshake.encode(exact))
    raw["reason_text"] += "x"
    with pytest.raises(ProtocolError) as caught:
        handshake.decode(msgpack.packb(raw))
    assert caught.value.code is Reason.LIMIT_EXCEEDED  # the handshake's string cap, while unpacking
    hello = handshake.AuthHello(agent_id="a" * MAX_ID_LEN, nonce=bytes(handshake.NONCE_NBYTES))
    assert handshake.decode(handshake.encode(hello)) == hello
    raw = msgpack.unpackb(handshake.encode(hello))
    raw["agent_id"] += "a"
    with pytest.raises(ProtocolError) as caught:
        handshake.decode(msgpack.packb(raw))
    assert caught.value.path == "$.auth_hello.agent_id"


def _data_plane_error(decoder, raw: dict) -> TransportError:
    with pytest.raises(TransportError) as caught:
        decoder(msgpack.packb(raw, use_bin_type=True))
    assert caught.value.code is Reason.BAD_FRAME
    return caught.value


def _chunk(**fields) -> dict:
    raw = {"v": 1, "t": "chunk", "xfer": 1, "room": "r", "gen": 0, "seq": 0, "regions": ["kv"], "runs": b""}
    return raw | fields


def test_data_plane_caps():
    at_limit = _chunk(regions=["kv"] * MAX_REGIONS_PER_CHUNK, room="r" * MAX_ID_LEN)
    assert len(frames.decode_data(msgpack.packb(at_limit)).wire.regions) == MAX_REGIONS_PER_CHUNK
    error = _data_plane_error(frames.decode_data, _chunk(regions=["kv"] * (MAX_REGIONS_PER_CHUNK + 1)))
    assert f"at $.chunk.regions: expected at most {MAX_REGIONS_PER_CHUNK} items" in str(error)
    assert "at $.chunk.room:" in str(
        _data_plane_error(frames.decode_data, _chunk(room="r" * (MAX_ID_LEN + 1)))
    )
    fail = {"v": 1, "t": "fail", "xfer": 1, "code": "aborted", "text": "x" * MAX_FAIL_TEXT_LEN}
    assert frames.decode_reply(msgpack.packb(fail)).text == "x" * MAX_FAIL_TEXT_LEN
    fail["text"] += "x"
    assert "at $.fail.text:" in str(_data_plane_error(frames.decode_reply, fail))
    sent = frames.decode_reply(frames.encode(frames.Fail(1, "aborted", "x" * 9000)))
    assert len(sent.text) == FAIL_TEXT_SENT_LEN
    assert len(_frame_of(DATA_PLANE_HEADER_NBYTES)) == frames.MAX_HEADER_NBYTES == staging.MAX_HEADER_NBYTES


def test_staging_ring_caps():
    assert staging.decode_request(staging.encode(staging.OpenRing(MAX_RING_SLOTS))).slots == MAX_RING_SLOTS
    error = _data_plane_error(staging.decode_request, {"v": 1, "t": "open", "slots": MAX_RING_SLOTS + 1})
    assert "at $.open.slots:" in str(error)
    ring = staging.Ring(tuple(range(MAX_RING_SLOTS)), 4096)
    assert staging.decode_ring(staging.encode(ring)) == ring
    over = {"v": 1, "t": "ring", "slots": list(range(MAX_RING_SLOTS + 1)), "slot_nbytes": 4096}
    assert "at $.ring.slots:" in str(_data_plane_error(staging.decode_ring, over))
    twice = {"v": 1, "t": "ring", "slots": [1, 1], "slot_nbytes": 4096}
    assert "at $.ring.slots: expected distinct slot indices" in str(
        _data_plane_error(staging.decode_ring, twice)
    )


def test_only_the_wire_layer_imports_msgpack():
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(name.split(".")[0] == "msgpack" for name in names):
                importers.append(str(path.relative_to(PACKAGE)))
    assert sorted(set(importers)) == ["wire/envelope.py"]
