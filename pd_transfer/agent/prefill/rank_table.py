"""Prefill rank 0's rank table server, from bind to close.

Rank 0 of a prefill instance serves the instance's rank table at the
``bootstrap`` address (:class:`~pd_transfer.agent.bootstrap.BootstrapServer`):
bound when its worker's registration is checked, before anything of it is
committed (a bind that fails refuses the registration, rather than leaving a
registered rank 0 whose instance no decode can find), served once the
registration is committed, kept across a worker loss (refusing with why until
a worker registers again), and closed when the sidecar stops, or when the
worker that comes back registers as another rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import zmq

from pd_transfer.agent.bootstrap import BootstrapServer
from pd_transfer.errors import PdTransferError, Reason

if TYPE_CHECKING:
    from pd_transfer.agent.prefill.records import PrefillRoom
    from pd_transfer.agent.side_context import SideContext
    from pd_transfer.layout.geometry import RankGeometry


class RankTableHost:
    """The rank table server this prefill sidecar serves, if it is its instance's rank 0."""

    def __init__(self, ctx: SideContext[PrefillRoom]) -> None:
        self.ctx = ctx
        self.server: BootstrapServer | None = None  # serving (or refusing while its worker is gone)
        self._bound: BootstrapServer | None = None  # bound for a registration not yet committed
        self._rank0 = False  # the registration under way is rank 0's

    def bind(self, geometry: RankGeometry) -> None:
        """Before a registration of ``geometry`` is committed: rank 0 binds the bootstrap
        address, unless it still serves it for a worker that was lost."""
        config = self.ctx.config
        self._rank0 = bool(config.bootstrap) and (geometry.tp_rank, geometry.pp_rank) == (0, 0)
        if not self._rank0 or self.server is not None:
            return
        try:
            self._bound = BootstrapServer(
                self.ctx.context,
                config.bootstrap,
                on_bad_frame=self.ctx.observe.bad_frame,
                on_closed=self.ctx.observe.connection_closed,
            )
        except zmq.ZMQError as err:
            raise PdTransferError(
                f"prefill rank 0 cannot serve the rank table at {config.bootstrap}: {err.strerror}",
                code=Reason.BOOTSTRAP_FAILED,
                hint="another process holds that address (another instance's rank 0?); give "
                "each prefill instance its own bootstrap address",
            ) from None

    def unbind(self) -> None:
        """The registration :meth:`bind` saw failed: an address bound for it is let go."""
        if self._bound is not None:
            self._bound.close()
            self._bound = None

    def registered(self) -> None:
        """The registration is committed: rank 0 serves its table (a server bound for it
        starts serving, one kept across a worker loss takes the worker back)."""
        if self._bound is not None:
            self.server, self._bound = self._bound, None
            self.ctx.spawn(self.server.serve())  # serves on after a worker loss (bootstrap.py)
        if self._rank0 and self.server is not None:
            self.server.worker_back()

    def drop_if_gone(self) -> None:
        """Rank 0's lost worker came back as another rank: its table is not this sidecar's."""
        if self.server is not None and self.server.gone:
            self.server.close()  # (its serve task ends with the socket)
            self.server = None

    def worker_lost(self, why: str) -> None:
        """Rank 0: no table until its worker is back, and whoever asks (past
        authentication) hears why at once (agent/bootstrap.py)."""
        if self.server is not None:  # why: "worker W is gone: its connection ..."
            self.server.worker_lost(
                f"prefill rank 0's {why}; it serves no rank table until a worker registers with it again"
            )

    def close(self) -> None:
        self.unbind()
        if self.server is not None:
            self.server.close()
            self.server = None
