"""Engines whose own listeners authenticate nobody, and the operator's acceptance of that.

The engine transports (``transport = "mooncake"`` or ``"nixl"``) move bytes
through an engine that opens listeners of its own, outside pd-transfer's
handshake. Neither engine authenticates a peer, and pd-transfer cannot put
its handshake in front of their wire protocols. What a stranger who reaches
those ports can do (measured on Mooncake 0.3.13 and NIXL 1.5.1 over UCX):

- Mooncake's transfer engine listens on every interface whatever
  ``data_host`` says (its RPC port on ``0.0.0.0``, its data port on ``[::]``,
  dual-stack; no setting of the engine changes that) and serves reads and
  writes of every buffer registered with it;
- NIXL's UCX listeners take any peer, and UCX's tcp transport writes wherever
  a peer's message points. They listen only on the interface holding
  ``data_host`` (:mod:`pd_transfer.transport.engines.interfaces`).

So a sidecar starts an engine transport only when its config accepts that
trust model by name, ``allow_unauthenticated_engine = true``
(``--allow-unauthenticated-engine``,
``PD_TRANSFER_ALLOW_UNAUTHENTICATED_ENGINE=1``); without it ``serve`` stops
with :func:`refusal` (exit code 2). Accepted, the sidecar says so at every
start, in ``/status``, ``/readyz`` and the ``pd_transfer_unauthenticated_engine``
gauge, as ``allow_insecure`` does.

Pure: reads the config it is given.
"""

from __future__ import annotations

from typing import Any

from pd_transfer.config.extras import ENGINES
from pd_transfer.errors import ConfigError

FIELD = "allow_unauthenticated_engine"
FLAG = "--allow-unauthenticated-engine"
VARIABLE = "PD_TRANSFER_ALLOW_UNAUTHENTICATED_ENGINE"

#: what a stranger who reaches the engine's own listeners can do, by engine
EXPOSURE = {
    "mooncake": (
        "Mooncake's transfer engine listens on every interface whatever data_host says "
        "(its RPC port on 0.0.0.0 and its data port on [::]) and serves reads and writes of "
        "the memory registered with it to anyone who connects: a stranger who reaches those "
        "ports can read this worker's pools (users' prompts as KV) and overwrite them"
    ),
    "nixl": (
        "NIXL's UCX listeners (on the interface holding data_host) accept any peer without "
        "authentication, and UCX's tcp transport writes wherever a peer's message points: a "
        "stranger who reaches them can read and overwrite this sidecar's memory, the worker's "
        "pools included"
    ),
}

FIX = (
    f"keep the engine's ports on a network only trusted hosts reach (a firewall or a private "
    f"network) and set {FIELD} = true ({FLAG}, {VARIABLE}=1) to accept that; or use "
    f"transport tcp, which authenticates every connection (and encrypts it with CURVE)"
)


def refusal(engine: str) -> str:
    """The one line a sidecar stops with when ``engine``'s trust model was not accepted."""
    return (
        f'transport = "{engine}" needs {FIELD} = true: {EXPOSURE[engine]}. '
        f"pd-transfer cannot authenticate these connections; {FIX}"
    )


def unauthenticated_engine(config: Any) -> str:
    """The engine whose listeners authenticate nobody that ``config`` runs, accepted
    ("" for none); ConfigError (exit code 2) when it runs one without accepting it.

    ``config`` is a :class:`~pd_transfer.config.sidecar.SidecarConfig` (``transport`` and
    ``allow_unauthenticated_engine``).
    """
    engine = config.transport if config.transport in ENGINES else ""
    if engine and not config.allow_unauthenticated_engine:
        raise ConfigError(refusal(engine))
    return engine


def warning(engine: str, listeners: list[str]) -> str:
    """The start log's warning for an accepted ``engine`` listening on ``listeners``."""
    where = ", ".join(listeners) if listeners else "ports it did not report"
    return (
        f"security: UNAUTHENTICATED ENGINE ({FIELD}): the {engine} engine listens on {where}; "
        f"{EXPOSURE[engine]}"
    )
