"""The optional engine transports by name: ``mooncake`` and ``nixl``.

Each is a pip extra (``pip install 'pd-transfer[mooncake]'``,
``'pd-transfer[nixl]'``) and brings two halves: a transport (the writing,
prefill side) and a receiver (the decode side, which registers its regions
with the engine and publishes them as its ``data_address``). This module
builds either half by name, so the agent needs no engine-specific code.
"""

from __future__ import annotations

import functools

from pd_transfer.config.extras import ENGINES, engine_missing
from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Receiver, Transport
from pd_transfer.transport.engines.staging.link_staging import ReceiverStaging, StagingOptions
from pd_transfer.transport.regions import Regions

__all__ = [
    "ENGINES",
    "ReceiverStaging",
    "StagingOptions",
    "engine_missing",
    "engine_unusable",
    "make_receiver",
    "make_transport",
]


@functools.cache
def engine_unusable(kind: str) -> str:
    """Why engine ``kind`` cannot run here, found by loading it ("" when it loads).

    Stronger than :func:`engine_missing`: an installed package whose shared
    libraries are absent (libibverbs1) fails here, not at the first connect.
    """
    missing = engine_missing(kind)
    if missing:
        return missing
    try:
        if kind == "mooncake":
            from pd_transfer.transport.engines.mooncake import load_engine_class

            load_engine_class()
        else:
            from pd_transfer.transport.engines.nixl import load_api

            load_api()
    except TransportError as err:
        return f"{err.message}; {err.hint}"
    return ""


def make_transport(
    kind: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    protocol: str = "tcp",
    staging: StagingOptions | None = None,
    ucx_threads: int = 1,
) -> Transport:
    """The writing half of engine ``kind``, its engine started (blocking, seconds).

    Starting it here, before a sidecar serves, keeps the seconds the engine
    takes to load (holding the GIL) off the event loop and its heartbeats.
    ``staging``: the strategy mode and the staging channel's authentication.
    ``ucx_threads``: nixl's writing agent's UCX threads (``nixl_ucx_threads``).
    """
    if kind == "mooncake":
        from pd_transfer.transport.engines.mooncake import MooncakeTransport

        mooncake = MooncakeTransport(host=host, protocol=protocol, port=port, staging=staging)
        mooncake.start()
        return mooncake
    if kind == "nixl":
        from pd_transfer.transport.engines.nixl import NixlTransport

        nixl = NixlTransport(host=host, staging=staging, ucx_threads=ucx_threads)
        nixl.start()
        return nixl
    raise TransportError(f"no engine transport {kind!r}; known: {list(ENGINES)}", code=Reason.INVALID_CONFIG)


def make_receiver(
    kind: str,
    regions: Regions,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    protocol: str = "tcp",
    transport: Transport | None = None,
    staging: ReceiverStaging | None = None,
) -> Receiver:
    """The receiving half: ``await receiver.start()`` returns the address to publish.

    With ``transport`` (this process's :func:`make_transport`), the receiver
    registers with that transport's engine (nixl: its receiving agent) instead
    of starting its own.
    ``staging``: its staging area and control channel (default: 16 slots of
    4 MiB, unauthenticated, on ``host``; zero slots: direct writes only).
    """
    staging = staging if staging is not None else ReceiverStaging(bind_host=host)
    if kind == "mooncake":
        from pd_transfer.transport.engines.mooncake import MooncakeReceiver, MooncakeTransport

        engine = transport.start() if isinstance(transport, MooncakeTransport) else None
        return MooncakeReceiver(
            regions, host=host, port=port, protocol=protocol, engine=engine, staging=staging
        )
    if kind == "nixl":
        from pd_transfer.transport.engines.nixl import NixlReceiver, NixlTransport

        nixl_engine = transport.receiving_engine() if isinstance(transport, NixlTransport) else None
        return NixlReceiver(regions, engine=nixl_engine, staging=staging, host=host)
    raise TransportError(f"no engine receiver {kind!r}; known: {list(ENGINES)}", code=Reason.INVALID_CONFIG)
