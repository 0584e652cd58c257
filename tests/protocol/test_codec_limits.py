"""Each decoding limit is enforced, with reason limit_exceeded or frame_too_large."""

import msgpack
import pytest
from protocol_samples import abort, transfer_request

from pd_transfer.errors import ProtocolError, Reason
from pd_transfer.protocol import DEFAULT_LIMITS, Limits, decode, encode

SMALL = Limits(max_frame_nbytes=4096, max_list_len=16, max_map_len=16, max_str_len=64, max_depth=4)


def _with_extra(value, limits=DEFAULT_LIMITS) -> ProtocolError:
    raw = msgpack.unpackb(encode(abort()))
    raw["extra"] = value
    with pytest.raises(ProtocolError) as caught:
        decode(msgpack.packb(raw, use_bin_type=True), limits)
    return caught.value


def test_oversized_frame_is_rejected_before_unpacking():
    frame = encode(abort())
    with pytest.raises(ProtocolError) as caught:
        decode(frame + b"\x00" * 5000, SMALL)
    assert caught.value.code is Reason.FRAME_TOO_LARGE
    assert str(caught.value) == (f"at $: frame of {len(frame) + 5000} bytes exceeds the limit of 4096 bytes")


def test_default_frame_limit_is_16_mib():
    with pytest.raises(ProtocolError) as caught:
        decode(b"\x00" * (16 * 1024 * 1024 + 1))
    assert caught.value.code is Reason.FRAME_TOO_LARGE


def test_too_long_list_is_rejected():
    error = _with_extra(list(range(17)), SMALL)
    assert error.code is Reason.LIMIT_EXCEEDED
    assert str(error) == "at $: frame exceeds a decoding limit: 17 exceeds max_array_len(16)"


def test_too_long_string_is_rejected():
    error = _with_extra("x" * 65, SMALL)
    assert error.code is Reason.LIMIT_EXCEEDED
    assert "exceeds max_str_len(64)" in str(error)


def test_too_big_map_is_rejected():
    error = _with_extra({str(i): i for i in range(17)}, SMALL)
    assert error.code is Reason.LIMIT_EXCEEDED
    assert "exceeds max_map_len(16)" in str(error)


def test_too_deep_nesting_is_rejected():
    # depth 1 is the frame map itself; [[[[1]]]] under it reaches depth 5
    error = _with_extra([[[[1]]]], SMALL)
    assert error.code is Reason.LIMIT_EXCEEDED
    assert str(error) == "at $: frame nests deeper than 4 levels"


def test_nesting_at_the_limit_is_accepted():
    raw = msgpack.unpackb(encode(abort()))
    raw["extra"] = [[[1]]]
    assert decode(msgpack.packb(raw), SMALL) == abort()


def test_nesting_beyond_msgpack_stack_is_a_limit_not_a_crash():
    deep = b"\x91" * 5000 + b"\x01"
    with pytest.raises(ProtocolError) as caught:
        decode(deep)
    assert caught.value.code is Reason.LIMIT_EXCEEDED


def test_msgpack_extension_types_are_refused():
    timestamp = b"\xd6\xff\x00\x00\x00\x01"
    raw = encode(abort())
    frame = raw[:1].replace(b"\x86", b"\x87") + raw[1:] + b"\xa1x" + timestamp
    with pytest.raises(ProtocolError) as caught:
        decode(frame)
    assert caught.value.code is Reason.LIMIT_EXCEEDED


def test_field_level_list_cap_applies_below_the_frame_limit():
    raw = msgpack.unpackb(encode(transfer_request()))
    raw["src_ranks"] = ["prefill[pp0,tp0]"] * 5000
    with pytest.raises(ProtocolError) as caught:
        decode(msgpack.packb(raw))
    assert caught.value.code is Reason.LIMIT_EXCEEDED
    assert str(caught.value) == "at $.transfer_request.src_ranks: expected at most 4096 items, got 5000"
