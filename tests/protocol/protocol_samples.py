"""Sample messages for protocol tests: one of every type, one per trigger."""

from __future__ import annotations

from functools import cache

from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import Mode
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.protocol import (
    Abort,
    AbortAck,
    Announce,
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
    RankEntry,
    RankTable,
    RegionHandle,
    Register,
    RoomRefused,
    TableRequest,
    TransferRequest,
    Trigger,
    Verdict,
)

ROOM = 7
GENERATION = 1


@cache
def geometry(role: Role) -> RankGeometry:
    """A small Llama-3.1-8B rank (TP 1, 2 pages) of ``role``."""
    return build_instance(
        load_preset("llama-3.1-8b"), role, 1, page_size=16, kv_layout=Layout.NHD, num_pages=2
    )[0]


def hello(role: Role) -> Hello:
    return Hello(
        agent_id=f"{role.value}-0",
        role=role,
        capabilities=Capabilities(transports=("shm", "tcp"), features=("per_layer_send",)),
    )


def register(role: Role) -> Register:
    return Register(agent_id=f"{role.value}-0", host_id="host-a", geometry=geometry(role))


def register_with_handles() -> Register:
    g = geometry(Role.DECODE)
    return Register(
        agent_id="decode-0",
        host_id="host-a",
        geometry=g,
        data_address="tcp://127.0.0.1:5601",
        region_handles=tuple(RegionHandle(r.id, f"pdt-w0-{i}") for i, r in enumerate(g.regions)),
        doorbell="pdt-decode-0-doorbells-1f0c2a9b7d3e",
    )


def rank_entry() -> RankEntry:
    return RankEntry(
        agent_id="prefill-0",
        host_id="host-a",
        control_address="tcp://127.0.0.1:5600",
        pp_size=1,
        geometry=geometry(Role.PREFILL),
    )


def bootstrap_messages() -> list[Message]:
    return [
        Announce(entry=rank_entry()),
        TableRequest(agent_id="decode-0"),
        RankTable(expected=2, entries=(rank_entry(),)),
    ]


ACCEPTED = Verdict(
    accepted=True,
    plan=(
        PoolPlan(
            Pool.KV,
            Mode.DIRECT,
            num_tensors=64,
            descriptors_per_item=64,
            nbytes_per_item=131072,
            strategy="staged",
        ),
        PoolPlan(Pool.AUX, Mode.REPLICATED, num_tensors=3, descriptors_per_item=1, nbytes_per_item=136),
    ),
)
ACCEPTED_CHECKED = Verdict(accepted=True, plan=ACCEPTED.plan, integrity=True, doorbell=True)
REJECTED = Verdict(
    accepted=False,
    headline="cannot reconcile prefill (attn_tp=1) with decode (attn_tp=1)",
    mismatches=(
        MismatchRecord(
            "kv.layer[3].k.dtype", Reason.DTYPE_MISMATCH, "bfloat16", "float8_e4m3fn", "use one kv dtype"
        ),
    ),
)


def transfer_request(room: int = ROOM, generation: int = GENERATION) -> TransferRequest:
    return TransferRequest(
        room=room,
        generation=generation,
        dst=(PoolIndices(Pool.KV, (0, 1)), PoolIndices(Pool.AUX, (5,))),
        src_ranks=("prefill[pp0,tp0]",),
        doorbell=(17, 4_000_000_000, 1),
    )


def progress(room: int = ROOM, generation: int = GENERATION) -> Progress:
    return Progress(room=room, generation=generation, done_nbytes=4096, total_nbytes=8192)


def done(room: int = ROOM, generation: int = GENERATION) -> Done:
    return Done(room=room, generation=generation, status=DoneStatus.SUCCESS)


def done_with_checksums(room: int = ROOM, generation: int = GENERATION) -> Done:
    return Done(
        room=room,
        generation=generation,
        status=DoneStatus.SUCCESS,
        checksums=(
            PoolChecksums(Pool.KV, items=(0, 2**32 - 1), tensors=(7, 8, 9)),
            PoolChecksums(Pool.AUX, items=(3,), tensors=(4,)),
        ),
    )


def failed_done(room: int = ROOM, generation: int = GENERATION) -> Done:
    return Done(
        room=room,
        generation=generation,
        status=DoneStatus.FAILED,
        reason=Reason.VIEW_OUT_OF_REGION,
        reason_text="page 9 is outside region kv.k.L0",
    )


def abort(room: int = ROOM, generation: int = GENERATION) -> Abort:
    return Abort(
        room=room, generation=generation, reason=Reason.ABORTED, reason_text="client cancelled the request"
    )


def abort_ack(room: int = ROOM, generation: int = GENERATION) -> AbortAck:
    return AbortAck(room=room, generation=generation, drained=True)


def room_refused(room: int = ROOM) -> RoomRefused:
    return RoomRefused(
        room=room,
        reason=Reason.PEER_REJECTED,
        reason_text="room 7: kv.layer[0].k.dtype: prefill=bfloat16 decode=float16",
    )


def heartbeat(role: Role) -> Heartbeat:
    return Heartbeat(agent_id=f"{role.value}-0", sequence=3, sent_unix_s=1_700_000_000.25)


def message_for(trigger: Trigger, sender: Role) -> Message:
    """A message that fires ``trigger`` when ``sender`` sends it; content is legal."""
    makers = {
        Trigger.HELLO: lambda: hello(sender),
        Trigger.REGISTER: lambda: register(sender),
        Trigger.VERDICT_ACCEPTED: lambda: ACCEPTED,
        Trigger.VERDICT_REJECTED: lambda: REJECTED,
        Trigger.TRANSFER_REQUEST: transfer_request,
        Trigger.PROGRESS: progress,
        Trigger.DONE: done,
        Trigger.ABORT: abort,
        Trigger.ABORT_ACK: abort_ack,
        Trigger.ROOM_REFUSED: room_refused,
        Trigger.HEARTBEAT: lambda: heartbeat(sender),
        Trigger.CLOSE: lambda: Close(),
    }
    return makers[trigger]()


def every_message() -> list[Message]:
    """At least one message of every type, with non-default field values."""
    return [
        hello(Role.DECODE),
        register(Role.PREFILL),
        register(Role.DECODE),
        ACCEPTED,
        ACCEPTED_CHECKED,
        REJECTED,
        transfer_request(),
        progress(),
        done(),
        done_with_checksums(),
        failed_done(),
        abort(),
        abort_ack(),
        room_refused(),
        heartbeat(Role.PREFILL),
        Close(),
        Close(reason=Reason.ILLEGAL_MESSAGE, reason_text="done sent twice"),
    ]


def every_frame_type() -> list[Message]:
    """Session messages plus the bootstrap ones and the optional Register fields."""
    return every_message() + [register_with_handles()] + bootstrap_messages()
