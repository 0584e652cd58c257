"""The chunks of a prefill room: what chunk ``i`` writes to one decode target.

A prefill worker sends a room in chunks (``send`` per chunk, ``last`` on the
final one). A decode rank may ask for the room after some chunks were
written to the others, so a room keeps every chunk's index lists until it
ends: at most ``max_chunks_per_room`` of them (one more fails the room with
``over_limit``: memory per room stays bounded).

Chunk ``i`` pairs its kv pages with the next pages the target allocated (a
cursor per target); the last chunk adds SWA pages, state slots and the aux
row, aux last (its arrival means everything before it landed). Counts that
do not match are refused, never truncated. Pure: no I/O.
"""

from __future__ import annotations

import numpy as np

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.views import Pool


def chunk_refusal(config, room) -> str:
    """Why the room may not take one more chunk ('' when it may)."""
    limit = config.max_chunks_per_room
    if len(room.chunks) < limit:
        return ""
    return (f"room {room.room}: more than max_chunks_per_room={limit} chunks (send calls); "
            f"send fewer, larger chunks or raise max_chunks_per_room")


def chunk_requests(room, target, index: int) -> dict:
    """``{pool: (src indices, dst indices)}`` of chunk ``index`` for ``target``."""
    chunk = room.chunks[index]
    last = room.last_received and index == len(room.chunks) - 1
    requests = {}
    src_kv = chunk.get(Pool.KV, np.zeros(0, np.int64))
    dst_kv = target.dst.get(Pool.KV, np.zeros(0, np.int64))
    end = target.kv_cursor + len(src_kv)
    if end > len(dst_kv) or (last and end != len(dst_kv)):
        raise PdTransferError(f"prefill sends {end if end > len(dst_kv) else end} kv page(s) but "
                              f"decode allocated {len(dst_kv)}; refused rather than truncated",
                              code=Reason.INDEX_COUNT_MISMATCH)
    if len(src_kv):
        requests[Pool.KV] = (src_kv, dst_kv[target.kv_cursor:end])
    if last:
        for pool in (Pool.SWA, Pool.MAMBA, Pool.AUX):
            src, dst = chunk.get(pool), target.dst.get(pool)
            if src is None and dst is None:
                continue
            if src is None or dst is None or len(src) != len(dst):
                raise PdTransferError(
                    f"{pool.value}: prefill sends {0 if src is None else len(src)} index(es), "
                    f"decode expects {0 if dst is None else len(dst)}",
                    code=Reason.INDEX_COUNT_MISMATCH)
            requests[pool] = (src, dst)
        # aux goes last: its arrival means everything before it landed
        if Pool.AUX in requests:
            requests[Pool.AUX] = requests.pop(Pool.AUX)
    return requests
