"""A decode room: what the decode side keeps of one room it expects.

Beside the common :class:`~pd_transfer.agent.rooms.Room` record: the prefill
instance it comes from (``bootstrap``, ``instance``), the destination indices
per pool, the prefill ranks that write it and which of them reported Done or
acknowledged an abort, and its doorbell slot (:mod:`.bells`). And the records of
those prefill instances (resolved by :mod:`.prefill_instances`): their ranks' sessions.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pd_transfer.agent.channels import OutgoingChannel
from pd_transfer.agent.rooms import Room
from pd_transfer.errors import PdTransferError
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import Verdict

if TYPE_CHECKING:
    from pd_transfer.transport.copy.checksums import BlockLayout


@dataclass
class DecodeRoom(Room):
    bootstrap: str = ""
    dst: dict[Pool, np.ndarray] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    done_from: set[str] = field(default_factory=set)
    acks: set[str] = field(default_factory=set)
    instance: PrefillInstance | None = None
    bell: tuple[int, int] | None = None  # doorbell (slot, token)
    requested: bool = False  # a TransferRequest went to a prefill rank
    held_pages: int = 0  # leading kv pages decode already holds: nothing is written into them


@dataclass
class PrefillPeer:
    rank_id: str
    channel: OutgoingChannel
    verdict: asyncio.Future[Verdict]
    integrity: BlockLayout | None = None  # when its Done checksums are verified
    rings: bool = False  # its verdict: it rings this rank's doorbells


@dataclass
class PrefillInstance:
    """One bootstrap address resolved: the prefill ranks this decode rank needs."""

    bootstrap: str
    peers: dict[str, PrefillPeer] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # the ranks that write to this rank
    error: PdTransferError | None = None
    lost: bool = False
    lost_s: float = 0.0  # when the first rank was lost
    lost_ranks: set[str] = field(default_factory=set)
    resolving: bool = True  # its resolution owns the sessions until it ends
