"""What a side is given of its sidecar: a :class:`SideContext`, and the worker's :class:`Registration`.

A side (:mod:`.prefill`, :mod:`.decode`) never holds its sidecar: the sidecar
builds one :class:`SideContext` for it, naming what the side uses (the
configuration, the room table, the observer, admission, the data plane, the
task owner, the generations, the registered worker) and nothing else, so a
side's reach into the sidecar is read from one dataclass and a type checker
holds it there. The worker's registration is one frozen value
(:class:`Registration`), replaced whole when a worker registers and dropped
when it is lost; a side reads it through :meth:`SideContext.registered`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol

from pd_transfer.agent.rooms import RoomT, RoomTable
from pd_transfer.errors import PdTransferError, Reason

if TYPE_CHECKING:
    from pd_transfer.agent.admission import Admission
    from pd_transfer.agent.auth import SecureContext, Security
    from pd_transfer.agent.channels import Channel
    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.agent.observe import Observer
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.layout.geometry import RankGeometry
    from pd_transfer.protocol import Capabilities


@dataclass(frozen=True)
class Registration:
    """The registered worker: its geometry, its regions' handles (region -> handle) and
    its instance's pipeline size, as the worker's register gave them."""

    worker_id: str
    geometry: RankGeometry
    handles: Mapping[str, str]
    pp_size: int


class Spawn(Protocol):
    """Run a coroutine in the background, owned by the sidecar (agent/tasks.py)."""

    def __call__(
        self, coro: Coroutine[Any, Any, Any], *, room: int | str = "", peer: str = ""
    ) -> asyncio.Task[Any]: ...


@dataclass(frozen=True)
class SideContext(Generic[RoomT]):
    """What a side uses of the sidecar that serves it (built by agent/sidecar.py)."""

    config: SidecarConfig
    context: SecureContext  # every socket a side opens is made from it (agent/auth.py)
    security: Security
    rooms: RoomTable[RoomT]
    observe: Observer
    admission: Admission
    dataplane: DataPlane
    spawn: Spawn
    next_generation: Callable[[], int]  # a new room's generation, unique in this sidecar
    capabilities: Callable[[], Capabilities]  # what this sidecar's Hello offers
    watch: Callable[[Channel, Callable[[str], None]], None]  # on_lost(why), once, for a peer
    registration: Callable[[], Registration | None]  # the registered worker, or None
    wait_registered: Callable[[float], Awaitable[None]]  # until a worker registered, bounded
    worker_lost_reason: Callable[[], str]  # why the last worker was let go ('' if none was)
    control_address: Callable[[], str]  # the control port's dial address ('' before it is served)

    @property
    def geometry(self) -> RankGeometry | None:
        """The registered worker's geometry, or None while no worker is registered."""
        registration = self.registration()
        return registration.geometry if registration is not None else None

    def registered(self) -> Registration:
        """The registered worker; refused (``not_registered``) while none is."""
        registration = self.registration()
        if registration is None:
            raise PdTransferError("the worker has not registered its pools yet", code=Reason.NOT_REGISTERED)
        return registration
