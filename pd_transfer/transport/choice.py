"""Which transport carries a peer pair's bytes: a pure decision, no I/O.

A prefill sidecar that accepted a decode peer knows two things: what the peer
offers (:class:`PeerOffer`: its host, whether it published region handles and
whether they are CUDA IPC handles) and what this sidecar can do
(:class:`LocalPlane`: the configured ``transport``, its host, whether its own
regions are CUDA memory). :func:`choose_transport` turns them into one
:class:`TransportKind` or a :class:`TransportRefusal` with its reason code and
text; the data plane then only opens the link of that kind.

    engine (mooncake, nixl) configured -> that engine, for every peer
    shm, or auto on the same host      -> device (CUDA IPC handles) or shm
    tcp, or auto across hosts          -> tcp

"Same host" is equal ``host_id`` *and* published region handles: without them
there is nothing to map. CUDA regions here move only by same-host copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import TransportKind

#: the configured ``transport`` values that name an engine, and the kind each is
ENGINE_KINDS = {"mooncake": TransportKind.MOONCAKE, "nixl": TransportKind.NIXL}


@dataclass(frozen=True)
class PeerOffer:
    """What a decode peer's registration offers for reaching its memory."""

    peer_id: str
    host_id: str
    has_handles: bool  # it published a handle (segment name or CUDA IPC handle) per region
    cuda_handles: bool  # one of them is a CUDA IPC handle


@dataclass(frozen=True)
class LocalPlane:
    """What this sidecar can do: its configured ``transport``, host, memory kind."""

    transport: str  # auto, shm, tcp, mooncake or nixl (the config's values)
    host_id: str
    on_device: bool  # this sidecar's worker registered CUDA memory


@dataclass(frozen=True)
class TransportRefusal:
    """Why no transport reaches the peer: ``code``, ``text`` naming both hosts, ``hint``."""

    code: Reason
    text: str
    hint: str

    def error(self) -> TransportError:
        return TransportError(self.text, code=self.code, hint=self.hint)


def choose_transport(peer: PeerOffer, local: LocalPlane) -> TransportKind | TransportRefusal:
    """The kind of link to open to ``peer``, or why none may be opened."""
    same_host = peer.host_id == local.host_id and peer.has_handles
    engine = ENGINE_KINDS.get(local.transport)
    use_shm = local.transport == "shm" or (local.transport == "auto" and same_host)
    hosts = f"peer host {peer.host_id!r}, this host {local.host_id!r}"
    if use_shm and not same_host:
        return TransportRefusal(
            Reason.TRANSPORT_FAILED,
            f"transport shm needs the decode peer on this host with published region handles ({hosts})",
            "use --transport tcp or auto across hosts",
        )
    if local.on_device and (engine is not None or not use_shm):
        return TransportRefusal(
            Reason.TRANSPORT_UNSUPPORTED,
            f"this sidecar's regions are CUDA memory, which only same-host copies move "
            f"(peer {peer.peer_id}: transport {'shm' if use_shm else local.transport}, {hosts})",
            "run the peers on one host with transport shm or auto, or register host pools",
        )
    if engine is not None:
        return engine
    if use_shm:
        return TransportKind.DEVICE if peer.cuda_handles else TransportKind.SHM
    return TransportKind.TCP
