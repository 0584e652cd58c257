"""What a GPU worker imports to talk to its pd-transfer sidecar.

    from pd_transfer.client import Client, allocate_pools

    with allocate_pools(geometry, owner_id="prefill-tp0") as pools, \
            Client("unix:///run/pd/worker.sock", "prefill-tp0") as client:
        client.register(geometry, pools.handles)
        client.send(room, pages[:64], last_chunk=False)
        client.send(room, pages[64:], state_slots=[slot], aux_row=row)
        state = client.wait(room, timeout_s=30)

On a GPU, :func:`allocate_cuda_pools` gives CUDA tensors whose ``handles`` are
CUDA IPC handles; the sidecars then copy device to device (same host). Make
the pages' writes visible (``torch.cuda.synchronize()`` or an event) before
``send``: the sidecar reads them from its own CUDA stream.

The registration lives as long as the connection of the client that made it:
keep that client open while the worker works. When it closes (the worker
exits, even by SIGKILL), the sidecar fails the worker's rooms with
``worker_lost``, releases its pools and takes the next registration, so a
restarted worker registers with the running sidecar.

:class:`Client` blocks the calling thread (in ``poll``, never spinning);
:class:`AsyncClient` offers the same calls as coroutines for asyncio workers.
Worker and sidecar talk over a plain Unix socket (``unix://``; or ZeroMQ,
``ipc://``) with the requests of :mod:`pd_transfer.protocol.worker_api`. When the sidecar requires
authentication, give the client the same shared secret (``secret=`` or
``secret_file=``, or ``PD_TRANSFER_SECRET_FILE`` / ``PD_TRANSFER_SECRET``).

Errors (all :class:`~pd_transfer.errors.PdTransferError`)::

    ClientError          a call did not succeed: .op, .code (Reason), .reason (text)
    ├── Refused          the sidecar answered ok: false (with its code and reason)
    ├── ReplyTimeout     no reply within the timeout
    ├── BadReply         a reply that does not follow worker_api
    ├── AuthFailed       the worker and the sidecar could not authenticate each other
    ├── SidecarLost      a unix:// connection closed during the call
    └── ClientClosed     the client is closed

May import the layout, protocol and security layers and shared memory; never the agent.
"""

from pd_transfer.client.aio import AsyncClient
from pd_transfer.client.cuda_pools import CudaPools, allocate_cuda_pools
from pd_transfer.client.errors import (
    AuthFailed,
    BadReply,
    ClientClosed,
    ClientError,
    Refused,
    ReplyTimeout,
    SidecarLost,
)
from pd_transfer.client.pools import Pools, allocate_pools
from pd_transfer.client.status import RoomState, RoomStatus
from pd_transfer.client.sync import Client

__all__ = [
    "AsyncClient",
    "AuthFailed",
    "BadReply",
    "Client",
    "ClientClosed",
    "ClientError",
    "CudaPools",
    "Pools",
    "Refused",
    "ReplyTimeout",
    "RoomState",
    "RoomStatus",
    "SidecarLost",
    "allocate_cuda_pools",
    "allocate_pools",
]
