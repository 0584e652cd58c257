"""A decode room: what the decode side keeps of one room it expects.

Beside the common :class:`~pd_transfer.agent.rooms.Room` record: the prefill
instance it comes from (``bootstrap``, ``instance``), the destination indices
per pool, the prefill ranks that write it and which of them reported Done or
acknowledged an abort, and its doorbell slot (:mod:`.bells`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pd_transfer.agent.rooms import Room
from pd_transfer.layout.views import Pool

if TYPE_CHECKING:
    from pd_transfer.agent.decode.instances import PrefillInstance


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
