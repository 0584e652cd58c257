"""Byte movers behind one interface (:class:`Transport`, :class:`Link`; receiving
sides: :class:`Receiver`).

    shm    same host: map the peer's shared-memory segments, copy in place
    tcp    plain TCP sockets: payloads sent from and received into the regions
           themselves (sendmsg / recvmsg_into), each chunk checked first
    zmq    the tcp data plane over ZeroMQ sockets, for CURVE encryption
    device same host, CUDA memory: the peer's IPC handles opened, torch copies
    mock   in-process, scripted faults, for tests

Every transport runs plans through :mod:`~pd_transfer.transport.copy.copy_engine` (or its gather and
scatter halves in :mod:`~pd_transfer.transport.copy.packing`), which bounds-checks every run against the
destination region before a byte moves.

Layering: may import ``pd_transfer.wire`` (its frames' codec), ``pd_transfer.layout``,
``pd_transfer.memory.segments``, numpy, torch, zmq and asyncio; never
``pd_transfer.agent`` or ``pd_transfer.protocol``.
"""

from pd_transfer.transport.base import Link, PeerEndpoint, PeerRegion, Receiver, Transport, TransportKind
from pd_transfer.transport.copy.copy_engine import CopyEngine, default_engine
from pd_transfer.transport.copy.packing import WireRuns, check_wire, gather, scatter, scatter_chunk
from pd_transfer.transport.device import DeviceTransport
from pd_transfer.transport.mock import Fault, FaultKind, MockTransport
from pd_transfer.transport.receiver_rooms import ByteRanges, ReceiverRooms, RoomPolicy, item_ranges
from pd_transfer.transport.shm import ShmTransport
from pd_transfer.transport.tcp.receiver import ReceiverStats, TcpReceiver
from pd_transfer.transport.tcp.transport import TcpTransport
from pd_transfer.transport.zmq.receiver import ZmqTcpReceiver
from pd_transfer.transport.zmq.transport import ZmqTcpTransport

__all__ = [
    "ByteRanges",
    "CopyEngine",
    "DeviceTransport",
    "Fault",
    "FaultKind",
    "Link",
    "MockTransport",
    "PeerEndpoint",
    "Receiver",
    "ReceiverStats",
    "PeerRegion",
    "ReceiverRooms",
    "RoomPolicy",
    "ShmTransport",
    "TcpReceiver",
    "TcpTransport",
    "Transport",
    "TransportKind",
    "WireRuns",
    "ZmqTcpReceiver",
    "ZmqTcpTransport",
    "check_wire",
    "default_engine",
    "gather",
    "item_ranges",
    "scatter",
    "scatter_chunk",
]
