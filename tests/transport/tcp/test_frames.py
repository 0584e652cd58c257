"""Data-plane frames: a peer's header is checked field by field, never trusted."""

import msgpack
import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.packing import WireRuns
from pd_transfer.transport.tcp.frames import (
    Ack,
    ChunkHeader,
    EndHeader,
    Fail,
    decode_data,
    decode_reply,
    encode,
)
from pd_transfer.transport.tcp.frames import (
    XferDone as Done,
)


def _pack(**fields) -> bytes:
    body = {
        "v": 1,
        "t": "chunk",
        "xfer": 1,
        "room": "r",
        "gen": 0,
        "seq": 0,
        "regions": ["kv"],
        "runs": np.zeros((1, 3), "<i8").tobytes(),
    }
    body.update(fields)
    return msgpack.packb({k: v for k, v in body.items() if v is not ...}, use_bin_type=True)


def test_frames_round_trip():
    wire = WireRuns(("kv.k.L0", "aux"), np.array([[0, 4096, 8192], [1, 0, 64]], np.int64))
    chunk = decode_data(encode(ChunkHeader(7, "room-1", 2, 3, wire)))
    assert (chunk.xfer, chunk.room, chunk.generation, chunk.seq) == (7, "room-1", 2, 3)
    assert chunk.wire.regions == wire.regions and np.array_equal(chunk.wire.runs, wire.runs)
    assert decode_data(encode(EndHeader(7, "room-1", 2, 4, 99))) == EndHeader(7, "room-1", 2, 4, 99)
    for reply in (Ack(7, 3, 8192), Done(7, 99), Fail(7, "run_out_of_region", "no")):
        assert decode_reply(encode(reply)) == reply
    assert Fail(1, "from_the_future", "").reason() is Reason.UNRECOGNIZED_REASON


@pytest.mark.parametrize(
    "frame,code",
    [
        (b"\xc1", Reason.BAD_FRAME),
        (msgpack.packb([1, 2]), Reason.BAD_FRAME),
        (_pack(v=2), Reason.VERSION_UNSUPPORTED),
        (_pack(t="launch"), Reason.UNKNOWN_MESSAGE),
        (_pack(xfer=-1), Reason.BAD_FRAME),
        (_pack(xfer=True), Reason.BAD_FRAME),
        (_pack(gen=2**63), Reason.BAD_FRAME),
        (_pack(room=...), Reason.BAD_FRAME),
        (_pack(room="x" * 300), Reason.BAD_FRAME),
        (_pack(regions="kv"), Reason.BAD_FRAME),
        (_pack(regions=[""]), Reason.BAD_FRAME),
        (_pack(regions=["kv"] * 5000), Reason.BAD_FRAME),
        (_pack(runs=b"\x00" * 23), Reason.BAD_FRAME),
        (_pack(runs=[[0, 0, 1]]), Reason.BAD_FRAME),
    ],
    ids=[
        "not-msgpack",
        "not-a-map",
        "version",
        "type",
        "negative",
        "bool",
        "huge",
        "missing",
        "long-room",
        "regions-str",
        "empty-region",
        "many-regions",
        "ragged-runs",
        "runs-list",
    ],
)
def test_malformed_headers_are_refused_with_a_reason(frame, code):
    with pytest.raises(TransportError) as info:
        decode_data(frame)
    assert info.value.code is code
