"""What a prefill sidecar keeps per decode peer and per room: peers, targets, rooms.

A :class:`Target` is one decode rank's request for one room: where its bytes go,
how far the writes got, and whether decode confirmed it has them (prefill's
Success waits for that, see docs/architecture.md#what-success-means). Plain
records; the logic is :mod:`~pd_transfer.agent.prefill.side`'s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from pd_transfer.agent.channels import Channel
from pd_transfer.agent.prefill.layers import ChunkLayers
from pd_transfer.agent.rooms import Room
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import Reconciliation
from pd_transfer.layout.views import Pool
from pd_transfer.memory.doorbell import Doorbells
from pd_transfer.protocol import CONFIRM_DONE, Register, TransferRequest

if TYPE_CHECKING:
    from pd_transfer.transport.base import Link
    from pd_transfer.transport.copy.checksums import BlockLayout, RoomDigest


@dataclass
class DecodePeer:
    channel: Channel
    register: Register | None = None
    reconciliation: Reconciliation | None = None
    fed: list[int] = field(default_factory=list)
    link: Link | None = None
    planner: PairPlanner | None = None
    accepted: bool = False
    features: tuple[str, ...] = ()  # decode's Hello features
    integrity: BlockLayout | None = None  # when both sides check integrity
    bells: Doorbells | None = None  # its doorbells, mapped (same host, shm)

    @property
    def rank_id(self) -> str:
        return self.register.geometry.rank_id if self.register else self.channel.label

    @property
    def registered(self) -> Register:
        """Its Register: what its session does after registering reads it."""
        if self.register is None:
            raise PdTransferError(
                f"decode peer {self.rank_id} has not registered", code=Reason.ILLEGAL_MESSAGE
            )
        return self.register

    @property
    def data_link(self) -> Link:
        """The link its accepted verdict connected: what writes to it go through."""
        if self.link is None:
            raise PdTransferError(f"decode peer {self.rank_id} has no data link", code=Reason.PEER_REJECTED)
        return self.link

    @property
    def pair_planner(self) -> PairPlanner:
        """The planner its accepted verdict made: what writes to it are planned with."""
        if self.planner is None:
            raise PdTransferError(f"decode peer {self.rank_id} has no plan", code=Reason.PEER_REJECTED)
        return self.planner


class TargetState(Enum):
    """Where a :class:`Target` is in its life.

    ``OPEN`` -> ``SUCCEEDED`` (every byte written, Done SUCCESS sent) or ``FAILED``
    (Done FAILED sent where it writes); ``OPEN`` -> ``ABORTING`` (decode aborted:
    no write starts, the one in flight finishes) -> ``FAILED``; ``OPEN`` -> ``ENDED``
    (a target this rank writes nothing to, once the room needs nothing more of it).
    The last three are final.
    """

    OPEN = "open"
    ABORTING = "aborting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ENDED = "ended"


FINAL = frozenset({TargetState.SUCCEEDED, TargetState.FAILED, TargetState.ENDED})


@dataclass
class Target:
    """One decode rank's request for a room."""

    peer: DecodePeer
    generation: int
    dst: dict[Pool, np.ndarray]
    writes: bool = True  # False: this rank writes nothing to that decode rank
    held: int = 0  # leading kv pages of dst decode already holds: nothing is written into them
    kv_cursor: int = 0
    chunks_done: int = 0
    nbytes: int = 0
    descriptors: int = 0
    started_s: float = field(default_factory=time.monotonic)
    state: TargetState = TargetState.OPEN
    admitted: bool = False  # holds a room slot with the peer (agent/prefill/flow.py)
    layers_sent: set[int] = field(default_factory=set)  # of the streamed chunk being written
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sums: RoomDigest | None = None  # of what was sent, when the pair checks integrity
    bell: tuple[int, int, int] | None = None  # (slot, token, writer) to ring once all landed
    confirmed: bool = False  # decode confirmed it has the bytes (its own Done)

    @property
    def done(self) -> bool:
        """Final: nothing more is written to it."""
        return self.state in FINAL

    @property
    def succeeded(self) -> bool:
        return self.state is TargetState.SUCCEEDED

    @property
    def failed(self) -> bool:
        """Aborted or failed: no further write starts."""
        return self.state in (TargetState.ABORTING, TargetState.FAILED)

    def abort(self) -> None:
        """Decode aborted it: an open target writes no more (the write in flight finishes)."""
        if self.state is TargetState.OPEN:
            self.state = TargetState.ABORTING

    def end(self) -> None:
        """No more writes to it: an aborting target ends failed, an open one ended."""
        if self.state is TargetState.ABORTING:
            self.state = TargetState.FAILED
        elif self.state is TargetState.OPEN:
            self.state = TargetState.ENDED

    @property
    def settled(self) -> bool:
        """Nothing more is owed: every byte written and, where decode confirms, confirmed."""
        if not self.done:
            return False
        return self.confirmed or not (self.writes and self.succeeded and CONFIRM_DONE in self.peer.features)


@dataclass
class PrefillRoom(Room):
    chunks: list[dict[Pool, np.ndarray]] = field(default_factory=list)
    layers: list[ChunkLayers | None] = field(default_factory=list)  # per chunk; None: not streamed
    last_received: bool = False
    targets: dict[int, Target] = field(default_factory=dict)  # by channel id
    expected_targets: int = 0
    refused: bool = False  # a send of it was refused: requests still arriving get its failure
    nbytes: int = 0
    owner: str = ""  # the decode instance the room is bound to (agent/prefill/ownership.py)
    # other instances' requests, until bound
    contenders: list[tuple[DecodePeer, TransferRequest]] = field(default_factory=list)
