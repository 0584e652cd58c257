"""The envelope: type tags, versions and unknown fields."""

import msgpack
import pytest
from protocol_samples import abort, hello, register

from pd_transfer.errors import ProtocolError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import PROTOCOL_VERSION, Close, decode, encode


def _raw(message):
    return msgpack.unpackb(encode(message))


def _decode_raw(raw):
    return decode(msgpack.packb(raw, use_bin_type=True))


def _reject(raw_or_frame) -> ProtocolError:
    frame = raw_or_frame if isinstance(raw_or_frame, bytes) else msgpack.packb(raw_or_frame)
    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    return caught.value


def test_unknown_top_level_field_is_ignored():
    raw = _raw(hello(Role.DECODE))
    raw["compression"] = {"kind": "zstd", "level": 3}
    assert _decode_raw(raw) == hello(Role.DECODE)


def test_unknown_nested_field_is_ignored():
    raw = _raw(register(Role.PREFILL))
    raw["geometry"]["views"][0]["memory_kind"] = "vram"
    raw["geometry"]["regions"][0]["ipc_handle"] = b"\x00" * 64
    assert _decode_raw(raw) == register(Role.PREFILL)


def test_missing_field_with_a_default_takes_the_default():
    raw = _raw(hello(Role.DECODE))
    del raw["capabilities"]
    assert _decode_raw(raw).capabilities.transports == ()


def test_unknown_message_type_is_rejected_with_reason():
    error = _reject({"t": "teleport", "v": [1, 0], "room": 1})
    assert error.code is Reason.UNKNOWN_MESSAGE
    assert str(error) == (
        "at $.t: unknown message type 'teleport'; protocol 1.0 knows hello, register, verdict, "
        "transfer_request, progress, done, abort, abort_ack, room_refused, heartbeat, close, announce, "
        "table_request, rank_table"
    )


def test_newer_major_version_is_rejected():
    raw = _raw(abort())
    raw["v"] = [PROTOCOL_VERSION[0] + 1, 0]
    error = _reject(raw)
    assert error.code is Reason.VERSION_UNSUPPORTED
    assert str(error) == (
        "at $.v: peer speaks protocol 2.0, this agent speaks 1.0; major versions must match"
    )


def test_older_major_version_is_rejected():
    raw = _raw(abort())
    raw["v"] = [0, 9]
    assert _reject(raw).code is Reason.VERSION_UNSUPPORTED


def test_newer_major_is_reported_before_an_unknown_type():
    assert _reject({"t": "teleport", "v": [2, 0]}).code is Reason.VERSION_UNSUPPORTED


def test_newer_minor_version_is_accepted():
    raw = _raw(abort())
    raw["v"] = [PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 7]
    raw["abort_source"] = "router"  # a field that minor version added
    assert _decode_raw(raw) == abort()


def test_unknown_reason_code_from_a_newer_peer_is_kept_in_the_text():
    raw = _raw(abort())
    raw["reason"] = "gpu_fell_off_the_bus"
    message = _decode_raw(raw)
    assert message.reason is Reason.UNRECOGNIZED_REASON
    assert message.reason_text == ("client cancelled the request [peer reason code 'gpu_fell_off_the_bus']")


@pytest.mark.parametrize(
    "raw, text",
    [
        ([1, 2], 'at $: expected a map with a type tag "t", got list'),
        ({"v": [1, 0]}, "at $.t: missing message type tag"),
        ({"t": "close"}, "at $.v: missing protocol version"),
        ({"t": 5, "v": [1, 0]}, "at $.t: expected str, got int"),
        ({"t": "close", "v": "1.0"}, "at $.v: expected [int, int], got str"),
        ({"t": "close", "v": [1]}, "at $.v: expected [int, int], got list of 1"),
        ({"t": "close", "v": [1, True]}, "at $.v[1]: expected int, got bool"),
    ],
)
def test_malformed_envelope_is_rejected_with_the_path(raw, text):
    assert str(_reject(raw)) == text


def test_bytes_that_are_not_msgpack_are_a_bad_frame():
    error = _reject(b"\xc1")
    assert error.code is Reason.BAD_FRAME
    assert str(error).startswith("at $: not a valid msgpack frame")


def test_trailing_bytes_after_the_frame_are_a_bad_frame():
    error = _reject(encode(Close()) + b"\x00")
    assert error.code is Reason.BAD_FRAME
    assert "extra data" in str(error)


def test_truncated_frame_is_a_bad_frame():
    assert _reject(encode(abort())[:-3]).code is Reason.BAD_FRAME


def test_invalid_utf8_is_a_bad_frame():
    frame = encode(Close(reason_text="ok")).replace(b"\xa2ok", b"\xa2\xff\xfe")
    assert _reject(frame).code is Reason.BAD_FRAME


def test_non_bytes_input_is_a_bad_frame():
    with pytest.raises(ProtocolError) as caught:
        decode("not bytes")  # type: ignore[arg-type]
    assert str(caught.value) == "at $: expected a bytes frame, got str"


def test_memoryview_and_bytearray_frames_decode():
    frame = encode(abort())
    assert decode(memoryview(frame)) == decode(bytearray(frame)) == abort()
