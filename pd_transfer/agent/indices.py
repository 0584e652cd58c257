"""A room's index lists checked against the registered pools before anything moves.

A worker's ``send``/``expect`` and a decode peer's TransferRequest name pages,
state slots and aux rows by index. Each list is refused here, naming the field
and the pool's extent, when an index lies outside the pool the rank registered
(``expect(room, bootstrap, [2**40 + 1])`` into a 16-page pool), and, for a
destination, when it names one page twice (two writes into one page). The
decode side also keeps the destinations of its live rooms (:class:`Claims`):
a room whose pages are another live room's is refused, since two writers into
one page is corruption waiting for a race.

Checked once per request, vectorised (numpy), never per byte. No I/O.
"""

from __future__ import annotations

import numpy as np

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.views import Pool

#: the worker API's name of each pool's index list
FIELDS = {Pool.KV: "pages", Pool.SWA: "swa_pages", Pool.MAMBA: "state_slots", Pool.AUX: "aux_row"}


def pool_extents(geometry: RankGeometry) -> dict[Pool, int]:
    """How many indices each pool of ``geometry`` has (the smallest over its views)."""
    extents: dict[Pool, int] = {}
    for view in geometry.views:
        extents[view.pool] = min(extents.get(view.pool, view.index_count), view.index_count)
    return extents


def check_indices(pools: dict[Pool, np.ndarray], geometry: RankGeometry, *, side: str, unique: bool) -> None:
    """Raise naming the field unless every index of ``pools`` is inside ``geometry``'s
    pools; with ``unique``, also unless no list repeats an index. ``side`` names
    whose pools they are in the message ("decode destination", ...)."""
    extents = pool_extents(geometry)
    for pool, indices in pools.items():
        field = FIELDS[pool]
        extent = extents.get(pool)
        if extent is None:
            raise PdTransferError(
                f"at $.{field}: {geometry.rank_id} registered no {pool.value} pool (it holds "
                f"no layer of it), but the request names {len(indices)} {side} index(es) in it",
                code=Reason.INDEX_OUT_OF_RANGE,
                hint=f"leave {field} empty in {geometry.rank_id}'s calls: a rank names only the "
                f"pools it registered (with pipeline parallelism, those of its own stage's layers)",
            )
        outside = np.flatnonzero((indices < 0) | (indices >= extent))
        if outside.size:
            at = int(outside[0])
            raise PdTransferError(
                f"at $.{field}[{at}]: {side} index {int(indices[at])} is outside "
                f"{geometry.rank_id}'s {pool.value} pool of {extent} ({outside.size} index(es) "
                f"outside)",
                code=Reason.INDEX_OUT_OF_RANGE,
                hint=f"{field} must be in [0, {extent})",
            )
        if unique and len(indices) > 1:
            repeated = _first_repeat(indices)
            if repeated is not None:
                raise PdTransferError(
                    f"at $.{field}: {side} index {repeated} appears more than once; two writes "
                    f"into one {pool.value} page or slot are refused",
                    code=Reason.INDEX_REPEATED,
                    hint="name each destination index once per room",
                )


def _first_repeat(indices: np.ndarray) -> int | None:
    ordered = np.sort(indices, kind="stable")
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[same[0]]) if same.size else None


class Claims:
    """The destination indices of the live rooms, per pool: which room holds each."""

    def __init__(self) -> None:
        self._owner: dict[Pool, dict[int, int]] = {pool: {} for pool in Pool}

    def claim(self, room: int, pools: dict[Pool, np.ndarray]) -> None:
        """Hold ``pools`` for ``room``; raise naming the other room if one holds any."""
        for pool, indices in pools.items():
            owner = self._owner[pool]
            for index in indices.tolist():
                other = owner.get(index)
                if other is not None and other != room:
                    raise PdTransferError(
                        f"at $.{FIELDS[pool]}: {pool.value} index {index} is a destination of "
                        f"live room {other}; a page or slot takes one room's bytes at a time",
                        code=Reason.INDEX_IN_USE,
                        hint=f"wait for room {other} to end (or abort it) before reusing its pages",
                    )
        for pool, indices in pools.items():
            self._owner[pool].update(dict.fromkeys(indices.tolist(), room))

    def holders(self, pools: dict[Pool, np.ndarray]) -> set[int]:
        """The live rooms holding any of ``pools``' indices."""
        return {
            room
            for pool, indices in pools.items()
            for index in indices.tolist()
            if (room := self._owner[pool].get(index)) is not None
        }

    def release(self, room: int, pools: dict[Pool, np.ndarray]) -> None:
        for pool, indices in pools.items():
            owner = self._owner[pool]
            for index in indices.tolist():
                if owner.get(index) == room:
                    del owner[index]
