"""Prefill: every decode instance's registrations, gathered before any verdict.

A decode instance of ``attn_tp * pp`` ranks registers rank by rank; with
pipeline parallelism each stage registers only its layers, so no single
rank's registration says whether the instance covers the model. A prefill
sidecar keeps the latest registration of every position ``(pp_rank,
tp_rank)`` per decode instance (the Register's ``instance`` name and shape)
and answers a rank's Register once every stage of its instance has a rank
registered, with the verdict on the whole pair (:func:`reconcile_instances`
over :func:`stage_representatives`, what ``pd-transfer check`` prints). Every
stage of a pipelined decode is asked about every room, so its ranks register
together; a PP 1 rank is its instance's only stage and is answered at once. A
rank re-registering (its sidecar restarted) replaces its position. A stage
with no rank registered within the bootstrap timeout is a rejection naming
it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from pd_transfer.layout.diagnostics import format_ranges
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.instance_reconcile import stage_representatives
from pd_transfer.protocol import Register

MAX_INSTANCES = 64  # decode instances remembered (least recently registered forgotten)


def instance_size(register: Register) -> int:
    """How many decode ranks the registering rank's instance has (each asks every room)."""
    return register.geometry.tp_size * register.pp_size


InstanceKey = tuple[str, int, int]  # a decode instance: its name, tp_size, pp_size


def _key(register: Register) -> InstanceKey:
    return register.instance, register.geometry.tp_size, register.pp_size


class DecodeInstances:
    """The decode ranks that registered with this prefill rank, per decode instance."""

    def __init__(self) -> None:
        self._ranks: OrderedDict[InstanceKey, dict[tuple[int, int], RankGeometry]] = OrderedDict()
        self._changed: dict[InstanceKey, asyncio.Event] = {}

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
        """``register``'s rank and one rank of every other stage, or None while a stage
        has none registered."""
        ranks = self._ranks.get(_key(register), {})
        if self.missing(register):
            return None
        own = register.geometry  # itself, whatever another rank at its position registered
        others = [
            g
            for (pp, tp), g in ranks.items()
            if pp < register.pp_size and tp < own.tp_size and (pp, tp) != (own.pp_rank, own.tp_rank)
        ]
        return stage_representatives(others, own)

    def missing(self, register: Register) -> str:
        """The stages with no rank registered yet: ``decode[pp1,tp0-3]``."""
        ranks = self._ranks.get(_key(register), {})
        tp = register.geometry.tp_size
        stages = {pp for pp, t in ranks if t < tp} | {register.geometry.pp_rank}
        return ", ".join(
            f"decode[pp{p},tp{format_ranges(list(range(tp)))}]"
            for p in range(register.pp_size)
            if p not in stages
        )

    async def gathered(self, register: Register, timeout_s: float) -> list[RankGeometry] | None:
        """Wait (bounded) until every stage of ``register``'s instance has a rank
        registered: :meth:`ranks` then, or None on timeout."""
        self.add(register)
        try:
            async with asyncio.timeout(timeout_s):
                while (ranks := self.ranks(register)) is None:
                    await self._changed.setdefault(_key(register), asyncio.Event()).wait()
        except TimeoutError:
            return None
        return ranks
