"""The field schema of every message: names, kinds, defaults, invariants.

:data:`RECORDS` maps each message class to the :class:`~fields.Record` that
encodes and decodes it. This is the one place that says what a frame of each
type holds; docs can be generated from it (each field's ``kind.description``).
Cross-field invariants are checked here too, on decode:

- a failed Done carries a reason code and text and no checksums; a successful
  one no reason; checksums name each pool once;
- a rejected Verdict lists at least one mismatch and no plan; an accepted
  one lists no mismatch;
- Progress never reports more bytes done than in total;
- a TransferRequest names at least one pool, each pool once.

Pure; imports :mod:`messages`, :mod:`fields` and :mod:`geometry_codec`.
"""

from __future__ import annotations

from typing import Any

from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.reconcile import Mode
from pd_transfer.layout.views import Pool
from pd_transfer.protocol.geometry_codec import GEOMETRY
from pd_transfer.protocol.messages import (
    Abort,
    AbortAck,
    Capabilities,
    Close,
    Done,
    DoneStatus,
    Heartbeat,
    Hello,
    Message,
    MismatchRecord,
    PoolChecksums,
    PoolIndices,
    PoolPlan,
    Progress,
    RegionHandle,
    Register,
    RoomRefused,
    TransferRequest,
    Verdict,
)
from pd_transfer.protocol.rank_table import Announce, RankEntry, RankTable, TableRequest
from pd_transfer.wire.fields import (
    Bool,
    EnumOf,
    Field,
    Float,
    Int,
    ListOf,
    Optional,
    ReasonCode,
    Record,
    Str,
    TupleOf,
    bad_field,
)
from pd_transfer.wire.limits import (
    MAX_ADDRESS_LEN,
    MAX_CAPABILITIES,
    MAX_CHECKSUM_ITEMS,
    MAX_CHECKSUM_TENSORS,
    MAX_ENGINE_ADDRESS_LEN,
    MAX_HANDLE_LEN,
    MAX_ID_LEN,
    MAX_MISMATCHES,
    MAX_PLAN_POOLS,
    MAX_RANK_ENTRIES,
    MAX_REGION_HANDLES,
    MAX_REQUEST_POOLS,
    MAX_SHORT_NAME_LEN,
    MAX_SRC_RANKS,
    MAX_TAG_LEN,
    MAX_TEXT_LEN,
)
from pd_transfer.wire.packed import Checksums, Indices

U64 = Int(hi=2**64 - 1)
U32 = Int(hi=2**32 - 1)
ID = Str(max_len=MAX_ID_LEN, min_len=1)
TEXT = Str(max_len=MAX_TEXT_LEN)
NAMES = ListOf(Str(max_len=MAX_TAG_LEN, min_len=1), MAX_CAPABILITIES)


def _note_unknown_reason(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    """Keep a newer peer's reason code in the text when we map it to unrecognized_reason."""
    if (
        values.get("reason") is Reason.UNRECOGNIZED_REASON
        and raw["reason"] != Reason.UNRECOGNIZED_REASON.value
    ):
        values["reason_text"] = f"{values['reason_text']} [peer reason code {raw['reason']!r}]"


def _check_done(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    failed = values["status"] is DoneStatus.FAILED
    if failed and (values["reason"] is None or not values["reason_text"]):
        raise bad_field(f"{path}.reason", "a failed Done must carry a reason code and text")
    if not failed and values["reason"] is not None:
        raise bad_field(f"{path}.reason", "a successful Done carries no reason")
    if failed and values["checksums"]:
        raise bad_field(f"{path}.checksums", "a failed Done carries no checksums")
    pools = [c.pool for c in values["checksums"]]
    if len(set(pools)) != len(pools):
        raise bad_field(f"{path}.checksums", f"pools repeat: {[p.value for p in pools]}")
    _note_unknown_reason(values, raw, path)


def _check_verdict(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    if values["accepted"] and values["mismatches"]:
        raise bad_field(f"{path}.mismatches", "an accepted verdict lists no mismatches")
    if not values["accepted"] and (not values["mismatches"] or values["plan"]):
        raise bad_field(f"{path}.mismatches", "a rejected verdict lists every mismatch and no plan")
    pairs = [(p.pool, p.mode) for p in values["plan"]]
    if len(set(pairs)) != len(pairs):
        raise bad_field(f"{path}.plan", "each (pool, mode) appears at most once")


def _check_progress(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    if values["done_nbytes"] > values["total_nbytes"]:
        raise bad_field(
            f"{path}.done_nbytes",
            f"{values['done_nbytes']} bytes done exceeds the total of {values['total_nbytes']}",
        )


def _check_request(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    pools = [d.pool for d in values["dst"]]
    if not pools:
        raise bad_field(f"{path}.dst", "a transfer request names at least one pool")
    if len(set(pools)) != len(pools):
        raise bad_field(f"{path}.dst", f"pools repeat: {[p.value for p in pools]}")


CAPABILITIES = Record(
    Capabilities, (Field("transports", NAMES, default=()), Field("features", NAMES, default=()))
)

POOL_PLAN = Record(
    PoolPlan,
    (
        Field("pool", EnumOf(Pool)),
        Field("mode", EnumOf(Mode)),
        Field("num_tensors", Int(hi=1 << 20)),
        Field("descriptors_per_item", Int(hi=1 << 32)),
        Field("nbytes_per_item", Int(hi=2**48)),
        Field("strategy", Str(max_len=MAX_SHORT_NAME_LEN), default=""),
    ),
)

MISMATCH = Record(
    MismatchRecord,
    (
        Field("path", Str(max_len=MAX_ADDRESS_LEN)),
        Field("code", ReasonCode()),
        Field("prefill", TEXT),
        Field("decode", TEXT),
        Field("hint", TEXT, default=""),
    ),
)

POOL_CHECKSUMS = Record(
    PoolChecksums,
    (
        Field("pool", EnumOf(Pool)),
        Field("items", Checksums(MAX_CHECKSUM_ITEMS)),
        Field("tensors", Checksums(MAX_CHECKSUM_TENSORS)),
    ),
)

POOL_INDICES = Record(PoolIndices, (Field("pool", EnumOf(Pool)), Field("indices", Indices())))

_ROOM = (Field("room", U64), Field("generation", U64))

ADDRESS = Str(max_len=MAX_ADDRESS_LEN)
CURVE_KEY_LEN = 40  # a Z85 CURVE public key
REGION_HANDLE = Record(
    RegionHandle,
    (Field("region", ID), Field("handle", Str(max_len=MAX_HANDLE_LEN, min_len=1))),
)
RANK_ENTRY = Record(
    RankEntry,
    (
        Field("agent_id", ID),
        Field("host_id", ID),
        Field("control_address", Str(max_len=MAX_ADDRESS_LEN, min_len=1)),
        Field("pp_size", Int(lo=1, hi=1024)),
        Field("geometry", GEOMETRY),
        Field("control_key", Str(max_len=CURVE_KEY_LEN), default=""),
    ),
)

RECORDS: dict[type[Message], Record] = {
    Hello: Record(
        Hello,
        (
            Field("agent_id", ID),
            Field("role", EnumOf(Role)),
            Field("protocol_version", TupleOf((Int(hi=65535), Int(hi=65535)))),
            Field("capabilities", CAPABILITIES, default=Capabilities()),
        ),
    ),
    Register: Record(
        Register,
        (
            Field("agent_id", ID),
            Field("host_id", ID),
            Field("geometry", GEOMETRY),
            # tcp://host:port, or an engine's address with its region table (engine_address.py)
            Field("data_address", Str(max_len=MAX_ENGINE_ADDRESS_LEN), default=""),
            Field("region_handles", ListOf(REGION_HANDLE, MAX_REGION_HANDLES), default=()),
            Field("doorbell", Str(max_len=MAX_ID_LEN), default=""),
            Field("instance", Str(max_len=MAX_ID_LEN), default=""),
            Field("pp_size", Int(lo=1, hi=1024), default=1),
            Field("pid", Int(hi=2**32 - 1), default=0),
            Field("process_start_ticks", U64, default=0),
        ),
    ),
    Verdict: Record(
        Verdict,
        (
            Field("accepted", Bool()),
            Field("plan", ListOf(POOL_PLAN, MAX_PLAN_POOLS), default=()),
            Field("headline", TEXT, default=""),
            Field("mismatches", ListOf(MISMATCH, MAX_MISMATCHES), default=()),
            Field("integrity", Bool(), default=False),
            Field("doorbell", Bool(), default=False),
            Field("transport", Str(max_len=MAX_SHORT_NAME_LEN), default=""),
        ),
        finish=_check_verdict,
    ),
    TransferRequest: Record(
        TransferRequest,
        (
            *_ROOM,
            Field("dst", ListOf(POOL_INDICES, MAX_REQUEST_POOLS)),
            Field("src_ranks", ListOf(ID, MAX_SRC_RANKS), default=()),
            # (slot, token, writer); tokens start at 1: a zeroed word is never a room's
            Field("doorbell", Optional(TupleOf((U32, Int(lo=1, hi=2**32 - 1), Int(hi=255)))), default=None),
            Field("held_pages", U32, default=0),
        ),
        finish=_check_request,
    ),
    Progress: Record(
        Progress,
        (
            *_ROOM,
            Field("done_nbytes", U64),
            Field("total_nbytes", U64),
        ),
        finish=_check_progress,
    ),
    Done: Record(
        Done,
        (
            *_ROOM,
            Field("status", EnumOf(DoneStatus)),
            Field("reason", Optional(ReasonCode()), default=None),
            Field("reason_text", TEXT, default=""),
            Field("checksums", ListOf(POOL_CHECKSUMS, MAX_REQUEST_POOLS), default=()),
        ),
        finish=_check_done,
    ),
    Abort: Record(
        Abort,
        (
            *_ROOM,
            Field("reason", ReasonCode()),
            Field("reason_text", Str(max_len=MAX_TEXT_LEN, min_len=1)),
        ),
        finish=_note_unknown_reason,
    ),
    AbortAck: Record(AbortAck, (*_ROOM, Field("drained", Bool()))),
    RoomRefused: Record(
        RoomRefused,
        (
            Field("room", U64),
            Field("reason", ReasonCode()),
            Field("reason_text", Str(max_len=MAX_TEXT_LEN, min_len=1)),
        ),
        finish=_note_unknown_reason,
    ),
    Heartbeat: Record(
        Heartbeat,
        (
            Field("agent_id", ID),
            Field("sequence", U64),
            Field("sent_unix_s", Float()),
            Field("stalled_s", Float(), default=0.0),
        ),
    ),
    Close: Record(
        Close,
        (
            Field("reason", Optional(ReasonCode()), default=None),
            Field("reason_text", TEXT, default=""),
        ),
        finish=_note_unknown_reason,
    ),
}

RECORDS.update(
    {
        Announce: Record(Announce, (Field("entry", RANK_ENTRY),)),
        TableRequest: Record(TableRequest, (Field("agent_id", ID),)),
        RankTable: Record(
            RankTable,
            (
                Field("expected", Int(hi=1 << 16)),
                Field("entries", ListOf(RANK_ENTRY, MAX_RANK_ENTRIES), default=()),
            ),
        ),
    }
)

RECORDS_BY_TAG: dict[str, tuple[type[Message], Record]] = {
    cls.TAG: (cls, record) for cls, record in RECORDS.items()
}
