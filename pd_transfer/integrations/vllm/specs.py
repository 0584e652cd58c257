"""What travels from the connector's scheduler side to its workers each step.

The scheduler-side connector and the worker-side connectors share nothing but
the metadata vLLM passes between them (possibly across processes, pickled):
these plain records, wrapped in the connector's ``KVConnectorMetadata``.

Pure; no vLLM, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SendSpec:
    """Prefill: send ``block_ids`` (the request's pages, in prompt order) as ``room``."""

    req_id: str
    room: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RecvSpec:
    """Decode: expect ``room`` from ``bootstrap_addr`` into ``block_ids``.

    The first ``num_local_blocks`` blocks hold tokens decode already had in
    its own prefix cache: the transfer still fills their pages (the sidecars
    map pages positionally), but the connector leaves vLLM's copy of them
    alone. ``error`` set: the request cannot be loaded (bad parameters); the
    worker reports it failed, with the reason, without calling the sidecar.
    """

    req_id: str
    room: int
    bootstrap_addr: str
    block_ids: tuple[int, ...]
    num_local_blocks: int = 0
    error: str = ""


@dataclass(frozen=True)
class AbortSpec:
    """Decode: the request ended while its KV was still arriving; abort ``room``."""

    req_id: str
    room: int


@dataclass
class StepSpecs:
    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    aborts: list[AbortSpec] = field(default_factory=list)
