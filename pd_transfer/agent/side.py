"""What a sidecar asks of its role: the :class:`Side` protocol.

A sidecar is the same process for both roles: the worker endpoint, the
rooms, the timers, the data plane, the HTTP server. What differs is its
side: :class:`~pd_transfer.agent.prefill.side.PrefillSide` answers decode peers
and sends; :class:`~pd_transfer.agent.decode.side.DecodeSide` resolves prefill
instances, requests rooms and receives. The sidecar calls its side only
through this protocol and never asks which role it has. A side that serves
peers' sessions on the control port (prefill: decode ranks connect to it)
is also a :class:`PeerServer`; the sidecar listens on that port only for
such a side.

A side is generic over its room type (:class:`~pd_transfer.agent.prefill.records.PrefillRoom`,
:class:`~pd_transfer.agent.decode.room.DecodeRoom`): the sidecar it serves holds a
room table of that type (``Sidecar[RoomT]``), so the rooms the sidecar hands back
(timed out, ended at shutdown) are the side's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

import numpy as np

from pd_transfer.agent.channels import Channel
from pd_transfer.agent.rooms import Room
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import Message
from pd_transfer.protocol.worker_api import WorkerOp
from pd_transfer.protocol.worker_requests import AbandonRequest, ExpectRequest, LayerReadyRequest, SendRequest

RoomT_contra = TypeVar("RoomT_contra", bound=Room, contravariant=True)


class Readiness(Protocol):
    """What ``/readyz`` asks of a side (agent/observe.py)."""

    @property
    def table_ready(self) -> asyncio.Event:
        """Set once this side's rank table is complete (prefill: every rank of its
        instance announced); always set on decode, which serves none. ``/readyz``
        reports a prefill sidecar unready until then."""

    def instance_problem(self, address: str) -> str:
        """Why the prefill instance at ``address`` (one of ``prefill_bootstraps``) is not
        usable yet, for ``/readyz``; '' once it is. Decode only: prefill resolves none."""


class Side(Readiness, Protocol[RoomT_contra]):
    # The worker's room operations, each a record read at the edge
    # (protocol/worker_requests.py); a send or expect is already checked against the
    # room table's bounds, and ``pools`` holds its indices by pool. Each returns the
    # reply; an operation this side does not serve raises PdTransferError
    # (``bad_frame``) naming the role (not_served below).
    async def on_send(self, request: SendRequest, pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        """A chunk of a room to send (prefill)."""

    async def on_expect(self, request: ExpectRequest, pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        """A room to receive (decode)."""

    async def on_layer_ready(self, request: LayerReadyRequest) -> dict[str, Any]:
        """A layer of a streamed chunk is computed (prefill)."""

    def on_abandon(self, request: AbandonRequest) -> dict[str, Any]:
        """A room this rank will never expect (decode)."""

    async def on_worker_abort(self, room_id: int) -> dict[str, Any]:
        """The worker aborts ``room_id``. Returns once this side may tell the worker
        whether the room's pages are safe to reuse (``drained`` in the reply)."""

    def on_timeout(self, room: RoomT_contra) -> None:
        """``room`` passed its deadline in its current state: fail it with ``timeout``
        and a reason saying what it was waiting for."""

    def fail_room(self, room: RoomT_contra, reason: Reason, text: str) -> Awaitable[None] | None:
        """Fail a live room with ``reason`` and ``text``, which the worker and the peers
        learn (the sidecar calls it for the rooms it will not finish as it shuts down).
        Prefill's failure returns an awaitable, done once no write of the room is in
        flight; decode's is settled when it returns (None)."""

    def before_registering(self, geometry: RankGeometry) -> None:
        """A worker's registration of ``geometry`` is checked and its regions are about to
        be mapped: bind what must be bound before it is committed (prefill rank 0: its
        rank table's address). Raises PdTransferError to refuse the registration."""

    def registration_failed(self) -> None:
        """The registration :meth:`before_registering` saw failed: release what it bound."""

    async def on_registered(self) -> None:
        """The worker registered (the sidecar holds its geometry and mapped its
        regions): start what serves it (join the instance, resolve peers)."""

    async def on_worker_lost(self, why: str) -> None:
        """The registered worker is gone (``why``): fail its live rooms with
        ``worker_lost``, stop what served it, and close the sessions that relied on its
        registration. Returns once no copy reads its regions any more."""

    def on_tick(self, now_s: float) -> None:
        """The sidecar's timer tick (every 0.1 s at most): periodic work of the side."""

    def check_bell(self, room: Room) -> None:
        """Before answering a poll or wait on ``room``: settle it if its doorbell rang."""

    def close(self) -> None:
        """The sidecar stopped: release what the side holds (doorbells, prefill rank 0's
        rank table server)."""


class PeerServer(Protocol):
    """A side whose peers open sessions to it on the control port; called from the
    event loop, once per event, and may not block."""

    async def on_peer_message(self, channel: Channel, message: Message) -> None:
        """A checked message of a peer's session (its first is its Hello)."""

    def on_peer_lost(self, channel: Channel, why: str) -> None:
        """The peer of ``channel`` is gone (missed heartbeats, a closed connection):
        fail its rooms with ``peer_lost`` and forget the session."""

    def on_peer_refused(self, channel: Channel) -> None:
        """This sidecar closed ``channel``'s session over a bad frame
        (``channel.refusal``): its rooms fail with that reason now, not at their
        timeout, and nothing of it is kept."""


def not_served(op: WorkerOp, role: str) -> PdTransferError:
    """The refusal of a worker operation the side of ``role`` does not serve."""
    return PdTransferError(f"{op.value} is not available on a {role} sidecar", code=Reason.BAD_FRAME)
