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
    """Prefill: send ``block_ids`` (the request's pages, in prompt order) as ``room``.

    A hybrid model's request also has blocks in its other groups: its
    Mamba/GDN state block(s) (``state_slots``) and its sliding-window pages
    (``swa_pages``, the window's blocks in prompt order). ``stream``: sent
    before the step's forward pass, each layer handed over as it is written.
    """

    req_id: str
    room: int
    block_ids: tuple[int, ...]
    state_slots: tuple[int, ...] = ()
    swa_pages: tuple[int, ...] = ()
    stream: bool = False


@dataclass(frozen=True)
class RecvSpec:
    """Decode: expect ``room`` from ``bootstrap_addr`` into ``block_ids``.

    The first ``num_local_blocks`` blocks hold tokens decode already had in
    its own prefix cache: they are expected as held pages (prefill writes
    nothing into them), and the connector leaves vLLM's copy of them alone. ``error`` set: the request cannot be loaded (bad parameters); the
    worker reports it failed, with the reason, without expecting the room, and
    abandons it (its prefill instance is told) when ``bootstrap_addr`` is known.
    ``state_slots`` and ``swa_pages``: as in :class:`SendSpec`, decode's;
    ``swa_first`` is the position of ``swa_pages[0]`` among the prompt's blocks.
    """

    req_id: str
    room: int
    bootstrap_addr: str
    block_ids: tuple[int, ...]
    num_local_blocks: int = 0
    error: str = ""
    state_slots: tuple[int, ...] = ()
    swa_pages: tuple[int, ...] = ()
    swa_first: int = 0


@dataclass(frozen=True)
class AbortSpec:
    """Decode: the request ended while its KV was still arriving; abort ``room``."""

    req_id: str
    room: int


@dataclass(frozen=True)
class AbandonSpec:
    """Decode: ``room`` of ``bootstrap_addr`` will never be expected (the request ended before
    its claim, or cannot load: ``reason``); the prefill instance is told, its room ends now."""

    req_id: str
    room: int
    bootstrap_addr: str
    reason: str


@dataclass
class StepSpecs:
    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    aborts: list[AbortSpec] = field(default_factory=list)
    abandons: list[AbandonSpec] = field(default_factory=list)
