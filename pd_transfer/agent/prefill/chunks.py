"""The chunks of a prefill room: what chunk ``i`` writes to one decode target.

A prefill worker sends a room in chunks (``send`` per chunk, ``last`` on the
final one). A decode rank may ask for the room after some chunks were
written to the others, so a room keeps every chunk's index lists until it
ends: at most ``max_chunks_per_room`` of them (one more fails the room with
``over_limit``: memory per room stays bounded).

Chunk ``i`` pairs its kv pages with the next pages the target allocated (a
cursor per target); the last chunk adds SWA pages, state slots and the aux
row, aux last (its arrival means everything before it landed). Counts that
do not match are refused, never truncated. Only the pools the pair moves are
paired and counted: with pipeline parallelism a stage may hold no layer of a
pool (every state layer on decode stage 2), and then names none of its
indices, while the stages that hold it do.

Where the pair's page sizes differ (prefill 16 tokens a page, decode 64), the
cursor still counts prefill pages, and chunk ``i`` is the
:class:`~pd_transfer.layout.spans.TokenSpan` of its tokens: they start at
``cursor * prefill page size`` and land in the decode pages that hold those
tokens. SWA window pages are the request's last pages on each side, so each
list is placed to end with its side's last KV page.

A decode that already holds the room's first kv pages (a prefix-cache hit,
the TransferRequest's ``held_pages``) is written nothing into them: the
pairs (or, where page sizes differ, the tokens) of those pages are left out
of each chunk. Pure: no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.spans import TokenSpan, request_lengths_agree
from pd_transfer.layout.views import Pool

if TYPE_CHECKING:
    from pd_transfer.agent.prefill.records import PrefillRoom, Target
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.layout.planner import PairPlanner

ChunkRequests: TypeAlias = "dict[Pool, tuple[np.ndarray, np.ndarray] | TokenSpan]"
"""One chunk's ``{pool: (src indices, dst indices)}`` for one target (a span where page sizes differ)."""


def chunk_refusal(config: SidecarConfig, room: PrefillRoom) -> str:
    """Why the room may not take one more chunk ('' when it may)."""
    limit = config.max_chunks_per_room
    if len(room.chunks) < limit:
        return ""
    return (
        f"room {room.room}: more than max_chunks_per_room={limit} chunks (send calls); "
        f"send fewer, larger chunks or raise max_chunks_per_room"
    )


def chunk_requests(room: PrefillRoom, target: Target, index: int) -> ChunkRequests:
    """``{pool: (src indices, dst indices)}`` of chunk ``index`` for ``target``.

    Only the pools the pair moves (:attr:`PairPlanner.pools`) are paired and
    counted: a stage without a pool's layers names none of its indices.
    """
    chunk = room.chunks[index]
    last = room.last_received and index == len(room.chunks) - 1
    planner = target.peer.planner
    moved = planner.pools if planner is not None else frozenset(Pool)
    requests: ChunkRequests = {}
    src_kv = chunk.get(Pool.KV, np.zeros(0, np.int64))
    if Pool.KV in moved:
        requests.update(_kv_requests(target, src_kv, planner, last))
    if last:
        requests.update(_last_pools(chunk, target, planner, len(src_kv), moved))
    return requests


def _kv_requests(
    target: Target, src_kv: np.ndarray, planner: PairPlanner | None, last: bool
) -> ChunkRequests:
    """The chunk's kv pages paired with the next pages ``target`` allocated."""
    dst_kv = target.dst.get(Pool.KV, np.zeros(0, np.int64))
    kv_sizes = planner.page_sizes(Pool.KV) if planner is not None else None
    if kv_sizes is not None:
        span = _kv_span(target.kv_cursor, src_kv, dst_kv, kv_sizes, last, target.held)
        return {Pool.KV: span} if len(src_kv) and len(span.dst_pages) else {}
    end = target.kv_cursor + len(src_kv)
    if end > len(dst_kv) or (last and end != len(dst_kv)):
        raise PdTransferError(
            f"prefill sends {end} kv page(s) but decode allocated {len(dst_kv)}; refused rather "
            f"than truncated",
            code=Reason.INDEX_COUNT_MISMATCH,
        )
    skip = min(max(target.held - target.kv_cursor, 0), len(src_kv))  # pages decode holds
    return {Pool.KV: (src_kv[skip:], dst_kv[target.kv_cursor + skip : end])} if len(src_kv) > skip else {}


def _last_pools(
    chunk: dict[Pool, np.ndarray],
    target: Target,
    planner: PairPlanner | None,
    num_chunk_kv: int,
    moved: frozenset[Pool],
) -> ChunkRequests:
    """SWA pages, state slots and aux rows of the last chunk, aux last."""
    requests: ChunkRequests = {}
    swa_sizes = planner.page_sizes(Pool.SWA) if planner is not None else None
    for pool in (Pool.SWA, Pool.MAMBA, Pool.AUX):
        src, dst = chunk.get(pool), target.dst.get(pool)
        if pool not in moved or (src is None and dst is None):
            continue
        if pool is Pool.SWA and swa_sizes is not None and src is not None and dst is not None:
            requests[pool] = _swa_span(
                src, dst, target.kv_cursor + num_chunk_kv, len(target.dst.get(Pool.KV, ())), swa_sizes
            )
            continue
        if src is None or dst is None or len(src) != len(dst):
            raise PdTransferError(
                f"{pool.value}: prefill sends {0 if src is None else len(src)} index(es), "
                f"decode expects {0 if dst is None else len(dst)}",
                code=Reason.INDEX_COUNT_MISMATCH,
            )
        requests[pool] = (src, dst)
    # aux goes last: its arrival means everything before it landed
    if Pool.AUX in requests:
        requests[Pool.AUX] = requests.pop(Pool.AUX)
    return requests


def _kv_span(
    cursor: int, src_kv: np.ndarray, dst_kv: np.ndarray, sizes: tuple[int, int], last: bool, held: int = 0
) -> TokenSpan:
    """The tokens of one chunk when page sizes differ (see the module docstring).

    prefill 16, decode 64, a chunk of 3 pages after 5: tokens 80-127, decode
    pages 1 (slots 16-63) and nothing of page 2. Decode's first ``held``
    pages are left out (their tokens are not owed): the span may be empty.
    """
    src_size, dst_size = sizes
    first, end = cursor * src_size, (cursor + len(src_kv)) * src_size
    if last and not request_lengths_agree(cursor + len(src_kv), len(dst_kv), src_size, dst_size):
        raise PdTransferError(
            f"prefill sends {cursor + len(src_kv)} kv page(s) of {src_size} tokens but decode "
            f"allocated {len(dst_kv)} of {dst_size}: no token count fills both; refused rather "
            f"than truncated",
            code=Reason.INDEX_COUNT_MISMATCH,
        )
    if not last and end > len(dst_kv) * dst_size:
        raise PdTransferError(
            f"prefill sends {end} tokens ({cursor + len(src_kv)} kv pages of {src_size}) but "
            f"decode allocated {len(dst_kv)} pages of {dst_size} ({len(dst_kv) * dst_size} "
            f"tokens); refused rather than truncated",
            code=Reason.INDEX_COUNT_MISMATCH,
        )
    high = min(len(dst_kv), -(-end // dst_size))
    low = min(max(first // dst_size, held), high)
    return TokenSpan(src_kv, dst_kv[low:high], first, low * dst_size)


def _swa_span(
    src: np.ndarray, dst: np.ndarray, src_kv_pages: int, dst_kv_pages: int, sizes: tuple[int, int]
) -> TokenSpan:
    """SWA window pages placed to end with each side's last KV page (same page size per side)."""
    if len(src) > src_kv_pages or len(dst) > dst_kv_pages:
        raise PdTransferError(
            f"swa: {len(src)} prefill and {len(dst)} decode window pages, but the request holds "
            f"{src_kv_pages} and {dst_kv_pages} kv pages: with different page sizes the window "
            f"pages are placed by the request's kv pages, so send those too",
            code=Reason.INDEX_COUNT_MISMATCH,
        )
    return TokenSpan(src, dst, (src_kv_pages - len(src)) * sizes[0], (dst_kv_pages - len(dst)) * sizes[1])
