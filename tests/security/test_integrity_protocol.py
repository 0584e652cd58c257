"""Integrity checksums on the wire: Done.checksums and Verdict.integrity, bounded and evolvable."""

import struct

import msgpack
import pytest

from pd_transfer.errors import ProtocolError, Reason
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import Done, DoneStatus, PoolChecksums, Verdict, decode, encode
from pd_transfer.wire.limits import MAX_CHECKSUM_TENSORS

DONE = Done(
    room=7,
    generation=1,
    status=DoneStatus.SUCCESS,
    checksums=(PoolChecksums(Pool.KV, items=(1, 2**32 - 1, 0), tensors=(5, 6)),),
)


def _raw(message) -> dict:
    return msgpack.unpackb(encode(message))


def _decode(raw: dict):
    return decode(msgpack.packb(raw, use_bin_type=True))


def _reject(raw: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        _decode(raw)
    return caught.value


def test_checksums_travel_as_packed_uint32_and_round_trip():
    raw = _raw(DONE)
    assert raw["checksums"][0]["items"] == struct.pack("<3I", 1, 2**32 - 1, 0)
    assert decode(encode(DONE)) == DONE


def test_a_peer_without_integrity_reads_a_plain_done_and_verdict():
    # an older sender omits the fields: the defaults mean "nothing to check"
    raw = _raw(Done(room=1, generation=1, status=DoneStatus.SUCCESS))
    del raw["checksums"]
    assert _decode(raw).checksums == ()
    verdict = _raw(Verdict(accepted=True))
    del verdict["integrity"]
    assert _decode(verdict).integrity is False


def test_checksum_bytes_must_be_whole_uint32s():
    raw = _raw(DONE)
    raw["checksums"][0]["items"] = b"\x01\x02\x03\x04\x05"
    assert str(_reject(raw)) == (
        "at $.done.checksums[0].items: expected packed uint32 bytes, got 5 bytes (not a multiple of 4)"
    )


def test_checksums_as_a_list_are_refused():
    raw = _raw(DONE)
    raw["checksums"][0]["tensors"] = [1, 2]
    assert str(_reject(raw)).startswith(
        "at $.done.checksums[0].tensors: expected packed little-endian uint32 bytes"
    )


def test_too_many_tensor_checksums_exceed_the_limit():
    raw = _raw(DONE)
    raw["checksums"][0]["tensors"] = bytes(4 * (MAX_CHECKSUM_TENSORS + 1))
    error = _reject(raw)
    assert error.code is Reason.LIMIT_EXCEEDED
    assert f"expected at most {MAX_CHECKSUM_TENSORS} checksums" in str(error)


def test_a_failed_done_carries_no_checksums():
    raw = _raw(DONE)
    raw.update(status="failed", reason="aborted", reason_text="stop")
    assert str(_reject(raw)) == "at $.done.checksums: a failed Done carries no checksums"


def test_a_pool_is_summed_once():
    raw = _raw(DONE)
    raw["checksums"].append(dict(raw["checksums"][0]))
    assert str(_reject(raw)) == "at $.done.checksums: pools repeat: ['kv', 'kv']"
