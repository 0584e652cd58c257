"""Engine plumbing that needs no engine: published addresses (untrusted) and address runs."""

from __future__ import annotations

import base64
import zlib

import msgpack
import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport.engines.address import MAX_ADDRESS_CHARS, EngineAddress
from pd_transfer.transport.engines.runs import (
    AddressRuns,
    batches,
    join,
    lower_to_addresses,
    split_long,
)


def _payload(value) -> str:
    return base64.urlsafe_b64encode(zlib.compress(msgpack.packb(value, use_bin_type=True))).decode()


def test_an_engine_address_round_trips():
    address = EngineAddress("nixl", "pdt-recv-1-ab", {"kv0": (0x7F00_0000_0000, 4096)}, b"\x00md")
    assert EngineAddress.parse(address.encode(), "nixl") == address


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("mooncake://h:1/" + _payload({"r": [["kv", 0, 16]]}), "out of range"),
        ("mooncake://h:1/" + _payload({"r": [["kv", 4096, 1 << 50]]}), "out of range"),
        ("mooncake://h:1/" + _payload({"r": [["kv", 4096, 16], ["kv", 8192, 16]]}), "listed twice"),
        ("mooncake://h:1/" + _payload({"r": [["kv", "4096", 16]]}), "$.r[0]"),
        ("mooncake://h:1/" + _payload({"r": "kv"}), "region list"),
        ("mooncake://h:1/" + _payload({"r": [], "m": "text"}), "$.m"),
        ("mooncake://h:1/!!not base64!!", "does not decode"),
        ("mooncake://bad host/" + _payload({"r": []}), "session"),
        (
            "mooncake://h:1/" + base64.urlsafe_b64encode(zlib.compress(b"\0" * (4 << 20))).decode(),
            "inflates past",
        ),
        ("mooncake://h:1/" + "A" * MAX_ADDRESS_CHARS, "characters"),
    ],
)
def test_a_malformed_peer_address_is_refused_naming_the_field(text, fragment):
    with pytest.raises(TransportError) as info:
        EngineAddress.parse(text, "mooncake")
    assert info.value.code is Reason.BAD_FIELD and fragment in str(info.value)


def test_a_peer_without_an_engine_address_is_unsupported():
    with pytest.raises(TransportError) as info:
        EngineAddress.parse("tcp://127.0.0.1:5601", "mooncake")
    assert info.value.code is Reason.TRANSPORT_UNSUPPORTED and "mooncake" in info.value.hint


def test_too_many_regions_to_publish_are_refused_at_the_source():
    regions = {f"region-{i:05d}-{'x' * 40}": (0x1000 + i * 977, 977) for i in range(2000)}
    with pytest.raises(TransportError) as info:
        EngineAddress("mooncake", "h:1", regions).encode()
    assert info.value.code is Reason.LIMIT_EXCEEDED


def _plan(src_offset, dst_offset, nbytes, count=None, src_stride=0, dst_stride=0) -> TransferPlan:
    n = len(src_offset)
    batch = RunBatch(
        "s",
        "d",
        np.array(src_offset, np.int64),
        np.array(dst_offset, np.int64),
        np.array(nbytes, np.int64),
        np.array(count or [1] * n, np.int64),
        src_stride,
        dst_stride,
    )
    return TransferPlan("p0", "d0", (batch,))


def test_runs_become_addresses_and_neighbours_on_both_sides_join():
    # runs 0 and 1 continue each other on both sides; run 2 continues only the source
    plan = _plan([0, 16, 32], [100, 116, 500], [16, 16, 16])
    runs = lower_to_addresses(plan, {"s": (1000, 64)}, {"d": (9000, 1024)})
    assert runs.src_addr.tolist() == [1000, 1032] and runs.dst_addr.tolist() == [9100, 9500]
    assert runs.nbytes.tolist() == [32, 16]


def test_strided_pieces_expand_before_they_become_addresses():
    # a sliced head: 3 pieces of 8 bytes, 32 apart in the source, back to back in the destination
    plan = _plan([0], [0], [8], count=[3], src_stride=32, dst_stride=8)
    runs = lower_to_addresses(plan, {"s": (0x10000, 128)}, {"d": (0x20000, 24)})
    assert runs.src_addr.tolist() == [0x10000, 0x10020, 0x10040]
    # back to back in the destination only: joining needs both sides, so they stay three
    assert runs.dst_addr.tolist() == [0x20000, 0x20008, 0x20010]
    assert runs.nbytes.tolist() == [8, 8, 8]


def test_a_run_past_the_geometry_is_refused_even_where_the_engine_registered_more():
    plan = _plan([0], [4000], [200])
    with pytest.raises(TransportError) as info:
        lower_to_addresses(plan, {"s": (1000, 4096)}, {"d": (9000, 8192)}, dst_sizes={"d": 4096})
    assert info.value.code is Reason.RUN_OUT_OF_REGION


def test_a_destination_region_the_peer_did_not_publish_is_unknown():
    with pytest.raises(TransportError) as info:
        lower_to_addresses(_plan([0], [0], [8]), {"s": (1000, 64)}, {"other": (9000, 64)})
    assert info.value.code is Reason.UNKNOWN_REGION


def test_long_runs_split_and_batches_are_capped():
    runs = AddressRuns(
        np.array([0, 1 << 30], np.uint64),
        np.array([1 << 32, 1 << 33], np.uint64),
        np.array([10, 25], np.int64),
    )
    pieces = split_long(runs, 10)
    assert pieces.nbytes.tolist() == [10, 10, 10, 5]
    assert pieces.src_addr.tolist() == [0, 1 << 30, (1 << 30) + 10, (1 << 30) + 20]
    assert [len(b) for b in batches(pieces, 3)] == [3, 1]
    assert join(pieces).nbytes.tolist() == [10, 25]
