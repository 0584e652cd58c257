"""The bootstrap's messages: prefill rank 0's rank table, asked for and announced to.

Not part of a session (:mod:`.messages` has those): a prefill rank announces
itself to rank 0's bootstrap socket, and anyone asks for the table. Same
framing and evolution rules as the session messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.protocol.messages import Message, MessageType


@dataclass(frozen=True)
class RankEntry:
    """One prefill rank as the rank table lists it."""

    agent_id: str
    host_id: str
    control_address: str
    pp_size: int
    geometry: RankGeometry
    # the CURVE public key the rank's control port serves with, when it is the rank's own
    # identity key (security/identity.py); '' = the deployment's shared key
    control_key: str = ""


@dataclass(frozen=True, kw_only=True)
class Announce(Message):
    """A prefill rank's sidecar -> rank 0's bootstrap: here I am."""

    TAG: ClassVar[str] = "announce"
    entry: RankEntry


@dataclass(frozen=True, kw_only=True)
class TableRequest(Message):
    """Anyone -> rank 0's bootstrap: send me the rank table."""

    TAG: ClassVar[str] = "table_request"
    agent_id: str


@dataclass(frozen=True, kw_only=True)
class RankTable(Message):
    """The prefill instance's ranks so far; complete when ``expected`` are listed."""

    TAG: ClassVar[str] = "rank_table"
    expected: int
    entries: tuple[RankEntry, ...] = ()

    @property
    def complete(self) -> bool:
        return self.expected > 0 and len(self.entries) >= self.expected


BOOTSTRAP_MESSAGE_TYPES: dict[str, MessageType] = {
    t.cls.TAG: t
    for t in (
        MessageType(Announce, "a prefill rank announces itself to rank 0's bootstrap"),
        MessageType(TableRequest, "ask rank 0's bootstrap for the prefill rank table"),
        MessageType(RankTable, "the prefill ranks registered so far and how many are expected"),
    )
}
