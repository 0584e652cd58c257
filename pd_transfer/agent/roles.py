"""A sidecar of either role: which side serves it, and its room type.

:class:`~pd_transfer.agent.sidecar.Sidecar` is generic over its side's room type;
:func:`sidecar_for` builds a ``Sidecar[PrefillRoom]`` (a :class:`PrefillSide`,
which also serves the decode peers' sessions on the control port) or a
``Sidecar[DecodeRoom]`` (a :class:`DecodeSide`) by the configured role, so the side
and the room table it shares with the sidecar agree on that type. A side is built
from the :class:`~pd_transfer.agent.side_context.SideContext` its sidecar gives it. The entry
point (``pd_transfer/commands/serve.py``) starts sidecars through here; nothing below
it names a role's side.
"""

from __future__ import annotations

from pd_transfer.agent.auth import Security
from pd_transfer.agent.decode.room import DecodeRoom
from pd_transfer.agent.decode.side import DecodeSide
from pd_transfer.agent.prefill.records import PrefillRoom
from pd_transfer.agent.prefill.side import PrefillSide
from pd_transfer.agent.side import PeerServer, Side
from pd_transfer.agent.side_context import SideContext
from pd_transfer.agent.sidecar import Sidecar
from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.layout.geometry import Role


def sidecar_for(
    config: SidecarConfig, drain_s: float = 5.0, security: Security | None = None
) -> Sidecar[PrefillRoom] | Sidecar[DecodeRoom]:
    """The sidecar of ``config``'s role."""
    if config.role is Role.PREFILL:
        return Sidecar(config, _prefill_side, drain_s, security)
    return Sidecar(config, _decode_side, drain_s, security)


def _prefill_side(ctx: SideContext[PrefillRoom]) -> tuple[Side[PrefillRoom], PeerServer | None]:
    side = PrefillSide(ctx)
    return side, side  # the control port serves its decode peers' sessions


def _decode_side(ctx: SideContext[DecodeRoom]) -> tuple[Side[DecodeRoom], PeerServer | None]:
    return DecodeSide(ctx), None
