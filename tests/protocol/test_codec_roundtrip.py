"""Every message survives encode -> decode unchanged, and travels by name."""

import msgpack
import pytest
from protocol_samples import every_frame_type, every_message, transfer_request

from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.protocol import (
    BOOTSTRAP_MESSAGE_TYPES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    MismatchRecord,
    PoolIndices,
    TransferRequest,
    Verdict,
    decode,
    encode,
)
from pd_transfer.protocol.schema import RECORDS


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert decode(encode(message)) == message


def test_samples_cover_every_message_type():
    every_type = set(MESSAGE_TYPES) | set(BOOTSTRAP_MESSAGE_TYPES)
    assert {type(m).TAG for m in every_frame_type()} == every_type
    assert {cls.TAG for cls in RECORDS} == every_type
    assert all(t.description for t in (MESSAGE_TYPES | BOOTSTRAP_MESSAGE_TYPES).values())


@pytest.mark.parametrize("message", every_frame_type()[-4:], ids=lambda m: type(m).__name__)
def test_bootstrap_messages_and_register_handles_round_trip(message):
    assert decode(encode(message)) == message


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__name__)
def test_frame_is_a_map_with_tag_version_and_named_fields(message):
    raw = msgpack.unpackb(encode(message))
    assert raw["t"] == type(message).TAG
    assert raw["v"] == list(PROTOCOL_VERSION)
    assert set(raw) - {"t", "v"} == {f.name for f in RECORDS[type(message)].fields}


def test_transfer_request_indices_travel_packed_and_decode_from_a_list_too():
    request = transfer_request()
    raw = msgpack.unpackb(encode(request))
    assert raw["dst"][0]["indices"] == (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    raw["dst"][0]["indices"] = [0, 1]
    assert decode(msgpack.packb(raw)) == request


def test_large_transfer_request_round_trips():
    request = TransferRequest(
        room=2**64 - 1, generation=3, dst=(PoolIndices(Pool.KV, tuple(range(200_000))),)
    )
    assert decode(encode(request)) == request


def test_rejection_carries_every_mismatch_of_a_real_reconciliation():
    spec = load_preset("llama-3.1-8b")
    prefill = build_instance(spec, Role.PREFILL, 2, page_size=16, kv_layout=Layout.NHD, num_pages=2)
    decode_ranks = build_instance(
        spec, Role.DECODE, 4, page_size=16, kv_layout=Layout.NHD, num_pages=2, kv_dtype="float8_e4m3fn"
    )
    error = reconcile(prefill, decode_ranks).error()
    verdict = Verdict(
        accepted=False,
        headline=error.headline,
        mismatches=tuple(MismatchRecord.from_mismatch(m) for m in error.mismatches),
    )
    back = decode(encode(verdict))
    assert back == verdict
    assert len(back.mismatches) == len(error.mismatches) >= 1
    assert (
        back.mismatches[0]
        .render()
        .endswith(".k.dtype: prefill=bfloat16 decode=float8_e4m3fn  [dtype_mismatch]")
    )


def test_a_verdict_plan_without_a_strategy_decodes_and_an_unknown_one_is_kept():
    from protocol_samples import ACCEPTED

    raw = msgpack.unpackb(encode(ACCEPTED))
    assert raw["plan"][0]["strategy"] == "staged"
    del raw["plan"][0]["strategy"]  # a peer from before the field
    raw["plan"][1]["strategy"] = "teleported"  # a newer peer's strategy
    plan = decode(msgpack.packb(raw)).plan
    assert (plan[0].strategy, plan[1].strategy) == ("", "teleported")
