"""Byte movers behind one interface (:class:`Transport`).

    shm    same host: map the peer's shared-memory segments, copy in place
    tcp    ZeroMQ data sockets: gathered chunks out, checked scatters in
    mock   in-process, scripted faults, for tests

Every transport runs plans through :mod:`.copy_engine` (or its gather and
scatter halves in :mod:`.packing`), which bounds-checks every run against the
destination region before a byte moves.

Layering: may import ``pd_transfer.layout``, ``pd_transfer.shm``, numpy,
torch, zmq and asyncio; never ``pd_transfer.agent`` or ``pd_transfer.protocol``.
"""

from pd_transfer.transport.base import Link, PeerEndpoint, RegionHandle, Transport, TransportKind
from pd_transfer.transport.copy_engine import CopyEngine, default_engine
from pd_transfer.transport.mock import Fault, FaultKind, MockTransport
from pd_transfer.transport.packing import WireRuns, check_wire, gather, scatter, scatter_chunk
from pd_transfer.transport.shm import ShmTransport
from pd_transfer.transport.tcp import TcpTransport
from pd_transfer.transport.tcp_receiver import ReceiverStats, TcpReceiver

__all__ = [
    "CopyEngine", "Fault", "FaultKind", "Link", "MockTransport", "PeerEndpoint", "ReceiverStats",
    "RegionHandle", "ShmTransport", "TcpReceiver", "TcpTransport", "Transport", "TransportKind",
    "WireRuns", "check_wire", "default_engine", "gather", "scatter", "scatter_chunk",
]
