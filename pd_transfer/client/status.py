"""Room status as the worker sees it: :class:`RoomStatus` and :class:`RoomState`.

A room's status is monotonic on the sidecar: Bootstrapping ->
WaitingForInput -> Transferring -> Success, or Failed (terminal, sticky,
always with a reason code and text). ``poll`` and ``wait`` replies carry it as
``status`` plus, when failed, ``code`` and ``reason``.

Pure data; imports only :mod:`pd_transfer.errors` and the protocol's
:class:`~pd_transfer.protocol.room_status.RoomStatus` (one status, on both sides).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.errors import Reason
from pd_transfer.protocol.room_status import RoomStatus


def reason_of(code_text: str | None) -> Reason | None:
    """The :class:`Reason` spelled ``code_text``; None when absent or unknown to this version."""
    if code_text is None:
        return None
    try:
        return Reason(code_text)
    except ValueError:
        return None


@dataclass(frozen=True)
class RoomState:
    """One observation of a room.

    ``code`` is the failure's :class:`Reason` (None unless failed, or when a
    newer sidecar sent a code this version does not know: ``code_text`` then
    still holds the wire spelling); ``reason`` is the human-readable text.
    """

    status: RoomStatus
    code: Reason | None = None
    reason: str = ""
    code_text: str | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    @property
    def succeeded(self) -> bool:
        return self.status is RoomStatus.SUCCESS

    @property
    def failed(self) -> bool:
        return self.status is RoomStatus.FAILED

    def describe(self) -> str:
        if self.status is RoomStatus.FAILED:
            return f"failed [{self.code_text or 'unknown'}]: {self.reason}"
        return self.status.value
