"""Which decode instance a prefill room belongs to, and what happens to anyone else who asks.

A router pairs a prefill instance with one decode instance per request. The
prefill worker names that decode instance in ``send(room, ..., decode=NAME)``;
each decode rank announces the instance it belongs to in its Register
(``instance_id`` in its config). The room is *bound* to that name: only
requests from ranks of that instance become targets, whatever order they
arrive in; the others are refused with ``not_room_owner`` and nothing of the
room reaches them. A worker that names no instance gets the first-claim rule:
the first named decode instance whose request arrived owns the room. Decode
ranks that name no instance keep the rule per rank: the first request for
each decode rank id wins, a second one is refused with ``duplicate_room``.

Until the worker's first ``send`` the owner is unknown, so requests from a
second instance wait as *contenders* (a few per room) instead of being
refused: a stranger who asks first cannot lock the rightful decode out. No
byte moves before that ``send``, so none reaches a contender.

With authentication on (the default), the name a decode rank registers is
checked against the agent id it proved in the handshake; see
docs/security.md for what that does and does not prove.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from pd_transfer.agent.prefill.decode_instances import instance_size
from pd_transfer.agent.prefill.records import TargetState
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.protocol import Done, DoneStatus

if TYPE_CHECKING:
    from pd_transfer.agent.channels import Channel
    from pd_transfer.agent.prefill.records import DecodePeer, PrefillRoom
    from pd_transfer.protocol import Register, TransferRequest

log = logging.getLogger(__name__)

OnRequest = Callable[["DecodePeer", "TransferRequest"], Awaitable[None]]
MAX_CONTENDERS = 16  # requests from other instances parked per room before its owner is known


def instance_of(peer: DecodePeer) -> str:
    """The decode instance a registered peer belongs to ('' if it names none)."""
    return peer.registered.instance


def claimant(room: PrefillRoom) -> str:
    """The named instance among the room's current targets ('' while there is none)."""
    return next((instance_of(t.peer) for t in room.targets.values() if instance_of(t.peer)), "")


async def refuse(peer: DecodePeer, message: TransferRequest | _Request, reason: Reason, text: str) -> None:
    """Answer a decode peer's TransferRequest with a failed Done; the room is untouched."""
    log.warning(
        "prefill: refused %s's request for room %d: %s",
        peer.rank_id,
        message.room,
        text,
        extra={"room": message.room, "peer": peer.rank_id},
    )
    try:
        await peer.channel.send(
            Done(
                room=message.room,
                generation=message.generation,
                status=DoneStatus.FAILED,
                reason=reason,
                reason_text=text,
            )
        )
    except Exception as err:  # the peer went away: nothing to tell
        log.debug("prefill: cannot refuse room %d to %s: %s", message.room, peer.rank_id, err)


async def admit_request(room: PrefillRoom, peer: DecodePeer, message: TransferRequest) -> bool:
    """True when ``peer``'s request for ``room`` may become a target; otherwise it
    was refused or parked as a contender."""
    instance = instance_of(peer)
    if not room.owner and room.chunks:
        # the worker sent, naming nobody: the first named claim binds (unless unnamed came first)
        room.owner = claimant(room) or ("" if room.targets else instance)
    if room.owner:
        if instance == room.owner:
            return True
        await refuse(
            peer,
            message,
            Reason.NOT_ROOM_OWNER,
            f"room {message.room} belongs to decode instance {room.owner!r}, "
            f"not to {instance!r} ({peer.rank_id})",
        )
        return False
    if not instance or claimant(room) in ("", instance):
        return True  # unnamed ranks: the per-rank duplicate check decides
    if len(room.contenders) >= MAX_CONTENDERS:
        await refuse(
            peer,
            message,
            Reason.DUPLICATE_ROOM,
            f"room {message.room} is claimed by {MAX_CONTENDERS + 1} decode instances",
        )
        return False
    room.contenders.append((peer, message))
    return False


def duplicate(room: PrefillRoom, peer: DecodePeer, peers: dict[int, DecodePeer], ttl_s: float) -> str:
    """Why ``peer``'s request for ``room`` is a duplicate ('' when it is not): another
    session asked for it as the same decode rank, or every rank of the instance did.

    A room id stays taken while the room is kept (``room_ttl_s`` after it ended):
    a decode rank that registered again (a new session) asking for an id its
    earlier registration used is told that, not that another peer owns it.
    """
    rank = peer.registered.geometry.rank_id
    earlier = next(
        (
            t
            for t in room.targets.values()
            if t.peer is not peer and t.peer.registered.geometry.rank_id == rank
        ),
        None,
    )
    if earlier is None:
        if not room.expected_targets or len(room.targets) < room.expected_targets:
            return ""
        if id(peer.channel) in room.targets:
            return ""
        return (
            f"room {room.room} already has a request from each of the {room.expected_targets} "
            f"rank(s) of its decode instance; {peer.channel.label} is not one of them"
        )
    other = earlier.peer
    if peers.get(id(other.channel)) is other and not other.channel.closed:
        return (
            f"room {room.room} already belongs to another live decode session as {rank}: "
            f"{other.channel.label}, not {peer.channel.label}"
        )
    if not room.terminal:
        return (
            f"room {room.room} was used by an earlier registration of {rank}, now closed, and is still "
            f"ending; a room id is retired for room_ttl_s={ttl_s:g} s after it ended: use a new id"
        )
    ago_s = time.monotonic() - room.finished_s
    return (
        f"room {room.room} was used by an earlier registration of {rank} (closed since; the decode "
        f"worker or sidecar registered again) and ended {room.status.value} {ago_s:.1f} s ago; "
        f"a room id is retired for room_ttl_s={ttl_s:g} s after it ended "
        f"({max(ttl_s - ago_s, 0):.1f} s left): use a new room id"
    )


async def bind(room: PrefillRoom, decode: str, request: OnRequest) -> None:
    """The worker's ``send`` for ``room``, naming ``decode`` ('' for none): fix the
    room's owner, refuse the targets and contenders of any other instance, and
    admit the owner's contenders (through ``request``, the side's ``on_request``)."""
    if room.owner:
        if decode and decode != room.owner:
            raise PdTransferError(
                f"room {room.room} is bound to decode instance {room.owner!r}; this send names {decode!r}",
                code=Reason.BAD_FIELD,
            )
        return
    room.owner = decode or claimant(room)
    if not room.owner:
        return  # nobody asked yet: the first claim binds (admit_request)
    for key, target in list(room.targets.items()):
        if instance_of(target.peer) != room.owner:
            del room.targets[key]
            target.state = TargetState.FAILED
            await refuse(
                target.peer,
                _Request(room.room, target.generation),
                Reason.NOT_ROOM_OWNER,
                f"room {room.room} belongs to decode instance {room.owner!r}, as its "
                f"prefill worker says, not to {instance_of(target.peer)!r}",
            )
    room.expected_targets = max((instance_size(t.peer.registered) for t in room.targets.values()), default=0)
    contenders, room.contenders = room.contenders, []
    for peer, message in contenders:
        await request(peer, message)


async def release_contenders(room: PrefillRoom, reason: Reason, text: str) -> None:
    """The room ended before its owner was known: its contenders learn why."""
    contenders, room.contenders = room.contenders, []
    for peer, message in contenders:
        await refuse(peer, message, reason, text)


class _Request:
    """The room and generation of a target's request, for :func:`refuse`."""

    def __init__(self, room: int, generation: int) -> None:
        self.room, self.generation = room, generation


def name_refusal(channel: Channel, register: Register) -> tuple[Reason, str] | None:
    """Why a decode rank may not register under the names in ``register`` (a reason code
    and text), or None. The agent id must be the one its handshake proved; with identities
    checked, its key must be a decode's, of the decode instance it names."""
    proven = channel.proven_agent_id
    if proven and register.agent_id != proven:
        return Reason.AUTH_FAILED, f"registered as {register.agent_id!r} but authenticated as {proven!r}"
    who = channel.proven_identity
    if who is None:
        return None
    if who.role != "decode":
        return (
            Reason.IDENTITY_MISMATCH,
            f"registered as a decode rank, but its identity key is {who.agent_id!r}'s, a {who.role}",
        )
    if register.instance != who.instance_id:
        return (
            Reason.IDENTITY_MISMATCH,
            f"registered for decode instance {register.instance!r}, but its identity key is "
            f"{who.agent_id!r}'s, of instance {who.instance_id!r}",
        )
    return None
