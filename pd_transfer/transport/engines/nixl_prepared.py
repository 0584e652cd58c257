"""The nixl transport's prepared descriptor lists, reused across rooms.

A plan's runs all start and end on multiples of some row size ``g`` (a 16 KiB
page row for a direct Llama pair, a 512-byte head slice for TP 2 -> 4). The
first write with a given ``g`` prepares every pool of both sides as rows of
``g`` bytes (``prep_xfer_dlist``); each write then only picks row indices
(``make_prepped_xfer``, one WRITE request). The lists live on the link (the
peer): its pools per ``g``, ours per ``g`` and the set of source pools with
their addresses, so pools registered again at other addresses get lists of
their own and a lost peer takes its lists with it. A link keeps at most
``MAX_PREPARED_LISTS`` of each, dropping (and releasing) the least recently
used. Where rows would be too many (``max_prepared_rows``), :func:`prepare`
returns None and a write describes its runs directly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from pd_transfer.transport.copy.runs import rows_of
from pd_transfer.transport.engines.nixl_agent import NixlEngine, release

MAX_ROW_NBYTES = 64 << 20  # rows of one prepared list; a plan of 256 MiB blocks: 4 rows each
MAX_PREPARED_LISTS = 4  # per link and side: row sizes (and source pool sets) kept prepared


@dataclass
class Prepared:
    """One side's regions prepared as rows of ``row_nbytes``; region -> first row index."""

    handle: object
    first_row: dict[str, int]
    bases: dict[str, tuple[int, int]]


def cached(cache: OrderedDict, key, make):
    """``cache[key]``, made by ``make()`` if missing; the least recently used beyond
    ``MAX_PREPARED_LISTS`` is released (the caller holds its link's lock: no request of
    the link is being built)."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    cache[key] = made = make()
    while len(cache) > MAX_PREPARED_LISTS:
        _, old = cache.popitem(last=False)
        drop(old)
    return made


def drop(prepared: Prepared | None) -> None:
    """Release a prepared list now; its handle then lets go of the agent (``release``)."""
    if prepared is not None:
        release(prepared.handle)


def prepare(engine: NixlEngine, agent: str, bases: dict, row: int, max_rows: int) -> Prepared | None:
    """``agent``'s regions ``bases`` as one list of ``row``-byte rows, or None past
    ``max_rows`` rows."""
    counts = {r: n // row for r, (_, n) in bases.items()}
    if sum(counts.values()) > max_rows:
        return None
    first_row, start = {}, 0
    for region_id, count in counts.items():
        first_row[region_id], start = start, start + count
    addresses = np.concatenate(
        [np.uint64(a) + np.arange(counts[r], dtype=np.uint64) * np.uint64(row) for r, (a, _) in bases.items()]
    )
    table = np.empty((len(addresses), 3), np.uint64)
    table[:, 0], table[:, 1], table[:, 2] = addresses, row, 0
    handle = engine.agent.prep_xfer_dlist(agent, table, "DRAM")
    return Prepared(handle, first_row, dict(bases))


def prepped_write(engine: NixlEngine, flat, runs, row: int, local: Prepared, remote: Prepared):
    """One WRITE request of ``runs`` (of the flat plan ``flat``) as row indices into the
    two prepared lists."""
    src_first = np.array([local.first_row[b.src_region] for b in flat.batches], np.int64)
    dst_first = np.array([remote.first_row[b.dst_region] for b in flat.batches], np.int64)
    src_rows = rows_of(runs.src_offset, runs.nbytes, row) + np.repeat(
        src_first[runs.batch], runs.nbytes // row
    )
    dst_rows = rows_of(runs.dst_offset, runs.nbytes, row) + np.repeat(
        dst_first[runs.batch], runs.nbytes // row
    )
    return engine.agent.make_prepped_xfer(
        "WRITE", local.handle, src_rows.astype(np.int32), remote.handle, dst_rows.astype(np.int32)
    )
