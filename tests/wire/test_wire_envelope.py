"""The one envelope: the same bytes as each framing always wrote, and strict headers."""

import msgpack
import pytest

from pd_transfer.errors import ProtocolError, Reason, TransportError
from pd_transfer.wire.envelope import Envelope, translated, unpack
from pd_transfer.wire.limits import Limits

VERSIONED = Envelope((1, 0), Limits())
NUMBERED = Envelope(1, Limits(), tag_noun="data-plane frame type")


def _refused(envelope, frame, tags=("hello",)) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        envelope.open(frame, tags)
    return caught.value


def test_versioned_frames_write_tag_then_version_list():
    frame = VERSIONED.pack("hello", {"room": 7})
    assert frame == msgpack.packb({"t": "hello", "v": [1, 0], "room": 7}, use_bin_type=True)
    assert VERSIONED.open(frame, ("hello",)) == ("hello", {"t": "hello", "v": [1, 0], "room": 7})


def test_numbered_frames_write_version_then_tag():
    frame = NUMBERED.pack("ack", {"xfer": 1, "blob": b"\x00"})
    assert frame == msgpack.packb({"v": 1, "t": "ack", "xfer": 1, "blob": b"\x00"}, use_bin_type=True)
    assert NUMBERED.open(frame, ("ack",))[0] == "ack"


def test_a_newer_minor_is_accepted_another_major_refused():
    assert VERSIONED.open(msgpack.packb({"t": "hello", "v": [1, 9]}), ("hello",))[0] == "hello"
    error = _refused(VERSIONED, msgpack.packb({"t": "hello", "v": [2, 0]}))
    assert error.code is Reason.VERSION_UNSUPPORTED and error.path == "$.v"


@pytest.mark.parametrize(
    "raw, path, code",
    [
        ([1], "$", Reason.BAD_FRAME),
        ({"v": 2, "t": "ack"}, "$.v", Reason.VERSION_UNSUPPORTED),
        ({"t": "ack"}, "$.v", Reason.VERSION_UNSUPPORTED),
        ({"v": 1, "t": "launch"}, "$.t", Reason.UNKNOWN_MESSAGE),
        ({"v": 1}, "$.t", Reason.UNKNOWN_MESSAGE),
    ],
)
def test_numbered_header_errors_name_the_field(raw, path, code):
    error = _refused(NUMBERED, msgpack.packb(raw), ("ack",))
    assert (error.path, error.code) == (path, code)


def test_unknown_tag_lists_the_known_ones():
    error = _refused(VERSIONED, VERSIONED.pack("teleport", {}), ("hello", "close"))
    assert str(error) == "at $.t: unknown message type 'teleport'; protocol 1.0 knows hello, close"
    assert error.code is Reason.UNKNOWN_MESSAGE


def test_unpack_translates_every_msgpack_failure():
    for frame, code in [
        (b"\xc1", Reason.BAD_FRAME),
        (msgpack.packb([1]) + b"\x00", Reason.BAD_FRAME),
        (msgpack.packb({1: 2}), Reason.BAD_FRAME),
        (msgpack.packb(msgpack.ExtType(1, b"x")), Reason.LIMIT_EXCEEDED),
    ]:
        with pytest.raises(ProtocolError) as caught:
            unpack(frame, Limits())
        assert caught.value.code is code and caught.value.path == "$"
    with pytest.raises(ProtocolError, match="expected a bytes frame, got str"):
        unpack("text", Limits())


def test_translated_keeps_the_path_and_the_kept_codes_only():
    unknown = ProtocolError("no", code=Reason.UNKNOWN_MESSAGE, path="$.t")
    field = ProtocolError(
        "expected at most 3 items, got 4", code=Reason.LIMIT_EXCEEDED, path="$.chunk.regions"
    )
    kept = {Reason.UNKNOWN_MESSAGE}
    assert translated(unknown, TransportError, "data-plane header", kept).code is Reason.UNKNOWN_MESSAGE
    error = translated(field, TransportError, "data-plane header", kept)
    assert isinstance(error, TransportError) and error.code is Reason.BAD_FRAME
    assert str(error) == "data-plane header: at $.chunk.regions: expected at most 3 items, got 4"
