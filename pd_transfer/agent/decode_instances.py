"""Prefill: every decode instance's registrations, gathered before any verdict.

A decode instance of ``attn_tp * pp`` ranks registers rank by rank; with
pipeline parallelism each stage registers only its layers, so no single
rank's registration says whether the instance covers the model. A prefill
sidecar keeps the latest registration of every position ``(pp_rank,
tp_rank)`` per decode instance (the Register's ``instance`` name and shape)
and answers each rank's Register once the whole instance has registered,
with the verdict on the whole pair (:func:`reconcile_instances`, the one
``pd-transfer check`` prints). A rank re-registering (its sidecar restarted)
replaces its position. An instance whose ranks do not all register within
the bootstrap timeout is rejected, naming the positions that are missing.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from pd_transfer.layout.diagnostics import format_ranges
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.protocol import Register

MAX_INSTANCES = 64   # decode instances remembered (least recently registered forgotten)


def instance_size(register: Register) -> int:
    """How many decode ranks the registering rank's instance has (each asks every room)."""
    return register.geometry.tp_size * register.pp_size


def _key(register: Register) -> tuple:
    return register.instance, register.geometry.tp_size, register.pp_size


class DecodeInstances:
    """The decode ranks that registered with this prefill rank, per decode instance."""

    def __init__(self) -> None:
        self._ranks: OrderedDict[tuple, dict[tuple[int, int], RankGeometry]] = OrderedDict()
        self._changed: dict[tuple, asyncio.Event] = {}

    def add(self, register: Register) -> None:
        key = _key(register)
        ranks = self._ranks.setdefault(key, {})
        self._ranks.move_to_end(key)
        geometry = register.geometry
        ranks[(geometry.pp_rank, geometry.tp_rank)] = geometry
        event = self._changed.pop(key, None)
        if event is not None:
            event.set()
        while len(self._ranks) > MAX_INSTANCES:
            forgotten, _ = self._ranks.popitem(last=False)
            self._changed.pop(forgotten, None)

    def ranks(self, register: Register) -> list[RankGeometry] | None:
        """The whole instance, PP stage major, or None while a position is missing."""
        ranks = self._ranks.get(_key(register), {})
        tp, pp = register.geometry.tp_size, register.pp_size
        positions = [(p, t) for p in range(pp) for t in range(tp)]
        if any(position not in ranks for position in positions):
            return None
        return [ranks[position] for position in positions]

    def missing(self, register: Register) -> str:
        """The positions not registered yet, folded per stage: ``decode[pp1,tp0-1]``."""
        ranks = self._ranks.get(_key(register), {})
        tp, pp = register.geometry.tp_size, register.pp_size
        parts = []
        for p in range(pp):
            absent = [t for t in range(tp) if (p, t) not in ranks]
            if absent:
                parts.append(f"decode[pp{p},tp{format_ranges(absent)}]")
        return ", ".join(parts)

    async def gathered(self, register: Register, timeout_s: float) -> list[RankGeometry] | None:
        """Wait (bounded) until ``register``'s whole instance registered; None on timeout."""
        self.add(register)
        try:
            async with asyncio.timeout(timeout_s):
                while (ranks := self.ranks(register)) is None:
                    await self._changed.setdefault(_key(register), asyncio.Event()).wait()
        except TimeoutError:
            return None
        # its own registration, whatever another rank at its position registered since
        own = register.geometry
        return [own if (g.pp_rank, g.tp_rank) == (own.pp_rank, own.tp_rank) else g for g in ranks]
